"""Exact encode/decode between bit patterns and values.

Formats with an ml_dtypes/numpy dtype use it (fast, and the reference for the field).
Configured binary formats use gfloat, a maintained library of generic float arithmetic; the
test suite checks both paths against each other on every code point up to 16 bits.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import gfloat
import numpy as np

from ..errors import FormatError
from .model import (
    BinaryFormat,
    BoolFormat,
    ComplexFormat,
    ExponentFormat,
    IntegerFormat,
    ScalarFormat,
)


@lru_cache(maxsize=256)
def gfloat_info(fmt: BinaryFormat) -> gfloat.FormatInfo:
    """The gfloat description of a binary format."""
    f = fmt.fraction_bits
    enc = fmt.encoding
    return gfloat.FormatInfo(
        fmt.tag,
        k=fmt.width,
        precision=f + 1,
        bias=fmt.bias,
        is_signed=True,
        domain=gfloat.Domain.Extended if enc == "ieee" else gfloat.Domain.Finite,
        has_nz=enc != "finite-unsigned-zero",
        num_high_nans={"ieee": (1 << f) - 1, "finite-max-nan": 1}.get(enc, 0),
        has_subnormals=True,
        is_twos_complement=False,
    )


def check_bits(fmt: ScalarFormat, bits: Any) -> np.ndarray:
    """``bits`` as an array of the format's storage dtype, with no bit set above the width."""
    bits = np.asarray(bits)
    if bits.dtype != fmt.storage_dtype:
        if bits.dtype.kind not in "ui":
            raise FormatError(f"bits of {fmt.tag} must be unsigned integers, got {bits.dtype}")
        if bits.size and (bits.min() < 0 or int(bits.max()) >> fmt.word_width):
            raise FormatError(f"bit patterns out of range for {fmt.word_width}-bit {fmt.tag}")
        bits = bits.astype(fmt.storage_dtype)
    width = fmt.word_width
    if width < bits.dtype.itemsize * 8 and bits.size and int(bits.max()) >> width:
        raise FormatError(f"bit patterns out of range for {width}-bit {fmt.tag}")
    if isinstance(fmt, BoolFormat) and bits.size and int(bits.max()) > 1:
        raise FormatError("bool bytes must be 0 or 1")
    if fmt.words_per_value == 2 and (bits.ndim == 0 or bits.shape[-1] != 2):
        raise FormatError(f"bits of {fmt.tag} need a trailing axis of 2 (real, imaginary)")
    return bits


def _require_float64(fmt: ScalarFormat, what: str) -> None:
    if isinstance(fmt, BinaryFormat) and not fmt.embeds_in_float64:
        hint = "; decode(..., exact=False) gives the nearest float64" if "decode" in what else ""
        raise FormatError(
            f"{fmt.tag} has values that are not binary64 values, so it cannot {what} exactly "
            f"through float64; keep its raw bits (lean_store.Encoded){hint}"
        )


def decode(fmt: ScalarFormat, bits: Any, *, exact: bool = True) -> np.ndarray:
    """Values of ``bits``: float64 for floats, complex128 for complex, the integers themselves.

    For a format whose values do not all embed in binary64, ``exact=True`` raises FormatError;
    ``exact=False`` gives the nearest float64 (for statistics and plots).
    """
    bits = check_bits(fmt, bits)
    if isinstance(fmt, ComplexFormat):
        out = np.empty(bits.shape[:-1], dtype=np.complex128)
        out.real = decode(fmt.component, bits[..., 0], exact=exact)
        out.imag = decode(fmt.component, bits[..., 1], exact=exact)
        return out
    if exact:
        _require_float64(fmt, "be decoded")
    dtype = fmt.numpy_dtype
    if isinstance(fmt, (IntegerFormat, BoolFormat)):
        return bits.view(dtype).copy()
    if dtype is not None:
        with np.errstate(invalid="ignore"):
            return bits.view(dtype).astype(np.float64)
    assert isinstance(fmt, BinaryFormat)
    return decode_generic(fmt, bits)


def decode_generic(fmt: BinaryFormat, bits: np.ndarray) -> np.ndarray:
    """gfloat's decode, for any binary format (also used to cross-check ml_dtypes)."""
    flat = np.ascontiguousarray(bits, dtype=np.uint64).reshape(-1)
    return np.asarray(gfloat.decode_ndarray(gfloat_info(fmt), flat), dtype=np.float64).reshape(
        bits.shape
    )


_NUMPY_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def encode(fmt: ScalarFormat, values: Any) -> np.ndarray:
    """Bit patterns of ``values`` under round-to-nearest-even and the format's special rules.

    Overflow: ``ieee`` gives infinity, ``finite-max-nan`` and ``finite-unsigned-zero`` give NaN
    (as ml_dtypes does), ``finite`` saturates to the largest finite value. NaN cannot be encoded
    in a ``finite`` format and raises FormatError. Integers must be integral and in range.
    """
    _require_float64(getattr(fmt, "component", fmt), "be encoded")
    if isinstance(fmt, ComplexFormat):
        values = np.asarray(values, dtype=np.complex128)
        real = encode(fmt.component, values.real)
        imag = encode(fmt.component, values.imag)
        return np.stack([real, imag], axis=-1)
    if isinstance(fmt, BoolFormat):
        arr = np.asarray(values)
        if arr.dtype != np.bool_ and not np.isin(arr, (0, 1)).all():
            raise FormatError("bool values must be 0 or 1")
        return arr.astype(np.bool_).view(np.uint8)
    if isinstance(fmt, IntegerFormat):
        return _encode_integer(fmt, values)
    values = np.asarray(values, dtype=np.float64)
    if isinstance(fmt, BinaryFormat) and fmt.encoding == "finite" and np.isnan(values).any():
        raise FormatError(f"{fmt.tag} has no NaN; cannot encode NaN values")
    dtype = fmt.numpy_dtype
    if dtype is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            out = values.astype(dtype).view(fmt.storage_dtype)
            if isinstance(fmt, BinaryFormat) and dtype not in _NUMPY_FLOATS:
                # ml_dtypes casts float64 through float32, which rounds twice: a value just off
                # a tie becomes the tie. Values float32 does not hold exactly are rounded once,
                # by gfloat, instead.
                twice = values.astype(np.float32).astype(np.float64) != values
                twice &= ~np.isnan(values)
                if twice.any():
                    out = np.array(out)
                    out[twice] = encode_generic(fmt, values[twice])
        return out
    assert isinstance(fmt, BinaryFormat)
    return encode_generic(fmt, values)


def encode_generic(fmt: BinaryFormat, values: np.ndarray) -> np.ndarray:
    """gfloat's round-then-encode for any binary format."""
    info = gfloat_info(fmt)
    flat = values.reshape(-1)
    # gfloat scales huge inputs with ldexp, which warns on the overflow that it then handles.
    with np.errstate(over="ignore", invalid="ignore"):
        if fmt.encoding in ("finite-max-nan", "finite-unsigned-zero"):
            # Out of range becomes NaN, as ml_dtypes does for fn/fnuz types.
            rounded = gfloat.round_ndarray(info, np.where(np.isinf(flat), np.nan, flat))
            rounded = np.where(np.isinf(rounded), np.nan, rounded)
        else:
            rounded = gfloat.round_ndarray(info, flat, sat=fmt.encoding == "finite")
    rounded = np.asarray(rounded, dtype=np.float64)
    codes = np.asarray(gfloat.encode_ndarray(info, rounded)).astype(fmt.storage_dtype)
    nan = np.isnan(rounded)
    if nan.any():
        # One NaN code per sign, the one ml_dtypes writes: quiet (top fraction bit) for ieee,
        # all ones for finite-max-nan, the negative-zero pattern for finite-unsigned-zero.
        codes[nan] = nan_code(fmt, np.signbit(flat[nan]))
    return codes.reshape(values.shape)


def nan_code(fmt: BinaryFormat, negative: Any) -> np.ndarray:
    """The canonical NaN bit pattern(s) of ``fmt`` for the given sign(s)."""
    f, top = fmt.fraction_bits, fmt.width - 1
    sign = np.asarray(negative, dtype=np.uint64) << np.uint64(top)
    if fmt.encoding == "finite-unsigned-zero":
        sign = np.full_like(sign, 1 << top)
        magnitude = 0
    elif fmt.encoding == "finite-max-nan":
        magnitude = (1 << top) - 1
    else:
        magnitude = (((1 << fmt.exponent_bits) - 1) << f) | (1 << (f - 1))
    return (sign | np.uint64(magnitude)).astype(fmt.storage_dtype)


def _encode_integer(fmt: IntegerFormat, values: Any) -> np.ndarray:
    arr = np.asarray(values)
    target = fmt.numpy_dtype
    assert target is not None
    if arr.dtype.kind in "iub":
        info = np.iinfo(target)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise FormatError(f"values out of range for {fmt.tag}")
        return arr.astype(target).view(fmt.storage_dtype)
    as_float = arr.astype(np.float64)
    if not np.isfinite(as_float).all() or (np.floor(as_float) != as_float).any():
        raise FormatError(f"{fmt.tag} values must be finite integers")
    info = np.iinfo(target)
    # info.max + 1 is a power of two, exact in float64; float(info.max) rounds up to it for
    # 64-bit types, so comparing with > would let 2**63 / 2**64 through and wrap on the cast.
    if as_float.size and (as_float.min() < info.min or as_float.max() >= float(info.max + 1)):
        raise FormatError(f"values out of range for {fmt.tag}")
    return as_float.astype(target).view(fmt.storage_dtype)


__all__ = [
    "decode",
    "decode_generic",
    "encode",
    "encode_generic",
    "check_bits",
    "gfloat_info",
    "nan_code",
]
_ = ExponentFormat  # exponent formats always have an ml_dtypes dtype
