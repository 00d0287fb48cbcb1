"""Tags: the standard names, the configured-format tag grammar, and numpy dtype lookup."""

from __future__ import annotations

import re
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import FormatError
from .model import (
    ENCODINGS,
    BinaryFormat,
    BoolFormat,
    ComplexFormat,
    ExponentFormat,
    IntegerFormat,
    ScalarFormat,
)

_FLOATS: dict[str, tuple[tuple[int, int, int, str], Any]] = {
    "float64": ((11, 52, 1023, "ieee"), np.float64),
    "float32": ((8, 23, 127, "ieee"), np.float32),
    "float16": ((5, 10, 15, "ieee"), np.float16),
    "bfloat16": ((8, 7, 127, "ieee"), ml_dtypes.bfloat16),
    "float8_e4m3fn": ((4, 3, 7, "finite-max-nan"), ml_dtypes.float8_e4m3fn),
    "float8_e4m3fnuz": ((4, 3, 8, "finite-unsigned-zero"), ml_dtypes.float8_e4m3fnuz),
    "float8_e5m2": ((5, 2, 15, "ieee"), ml_dtypes.float8_e5m2),
    "float8_e5m2fnuz": ((5, 2, 16, "finite-unsigned-zero"), ml_dtypes.float8_e5m2fnuz),
    "float8_e4m3": ((4, 3, 7, "ieee"), ml_dtypes.float8_e4m3),
    "float8_e3m4": ((3, 4, 3, "ieee"), ml_dtypes.float8_e3m4),
    "float6_e2m3fn": ((2, 3, 1, "finite"), ml_dtypes.float6_e2m3fn),
    "float6_e3m2fn": ((3, 2, 3, "finite"), ml_dtypes.float6_e3m2fn),
    "float4_e2m1fn": ((2, 1, 1, "finite"), ml_dtypes.float4_e2m1fn),
}

STANDARD: dict[str, ScalarFormat] = {name: BinaryFormat(*p) for name, (p, _) in _FLOATS.items()}
STANDARD["float8_e8m0fnu"] = ExponentFormat()
for _bits in (8, 16, 32, 64):
    STANDARD[f"int{_bits}"] = IntegerFormat(_bits, True)
    STANDARD[f"uint{_bits}"] = IntegerFormat(_bits, False)
STANDARD["bool"] = BoolFormat()
STANDARD["complex64"] = ComplexFormat(STANDARD["float32"])
STANDARD["complex128"] = ComplexFormat(STANDARD["float64"])

_NAME_OF: dict[ScalarFormat, str] = {fmt: name for name, fmt in STANDARD.items()}
_DTYPES: dict[ScalarFormat, np.dtype] = {
    STANDARD[name]: np.dtype(dtype) for name, (_, dtype) in _FLOATS.items()
}
_DTYPES[STANDARD["float8_e8m0fnu"]] = np.dtype(ml_dtypes.float8_e8m0fnu)
for _bits in (8, 16, 32, 64):
    _DTYPES[STANDARD[f"int{_bits}"]] = np.dtype(f"int{_bits}")
    _DTYPES[STANDARD[f"uint{_bits}"]] = np.dtype(f"uint{_bits}")
_DTYPES[STANDARD["bool"]] = np.dtype(np.bool_)
_DTYPES[STANDARD["complex64"]] = np.dtype(np.complex64)
_DTYPES[STANDARD["complex128"]] = np.dtype(np.complex128)
_FORMAT_OF_DTYPE: dict[np.dtype, ScalarFormat] = {dt: fmt for fmt, dt in _DTYPES.items()}

_NATURAL = r"(0|[1-9][0-9]*)"  # canonical spelling only: one tag per format
_ENCODING = "(" + "|".join(map(re.escape, ENCODINGS)) + ")"
_BINARY_TAG = re.compile(rf"binary_{_NATURAL}_{_NATURAL}_(0|-?[1-9][0-9]*)_{_ENCODING}")
_COMPLEX_TAG = re.compile(r"complex\((.+)\)")


def tag_of(fmt: ScalarFormat) -> str:
    """The standard name, or the configured tag that carries every parameter."""
    name = _NAME_OF.get(fmt)
    if name is not None:
        return name
    if isinstance(fmt, BinaryFormat):
        return f"binary_{fmt.exponent_bits}_{fmt.fraction_bits}_{fmt.bias}_{fmt.encoding}"
    if isinstance(fmt, ComplexFormat):
        return f"complex({fmt.component.tag})"
    raise FormatError(f"format {fmt!r} has no tag")  # pragma: no cover - all kinds named above


def numpy_dtype_of(fmt: ScalarFormat) -> np.dtype | None:
    return _DTYPES.get(fmt)


def get(tag: str) -> ScalarFormat:
    """Look a format up by tag: a standard name, ``binary_E_F_BIAS_ENC`` or ``complex(TAG)``."""
    if not isinstance(tag, str):
        raise FormatError(f"a format tag must be a string, got {type(tag).__name__}")
    fmt = STANDARD.get(tag)
    if fmt is not None:
        return fmt
    if len(tag) <= 200:
        match = _BINARY_TAG.fullmatch(tag)
        if match:
            e, f, bias, enc = match.groups()
            return binary(int(e), int(f), bias=int(bias), encoding=enc)
        match = _COMPLEX_TAG.fullmatch(tag)
        if match:
            return complex_of(get(match.group(1)))
    known = ", ".join(STANDARD)
    raise FormatError(
        f"unknown format tag {tag[:80]!r}; known tags: {known}, "
        "binary_E_F_BIAS_ENCODING and complex(TAG)"
    )


def default_bias(exponent_bits: int, encoding: str) -> int:
    """The IEEE bias 2^(e-1) - 1, plus one for ``finite-unsigned-zero``."""
    bias = (1 << (exponent_bits - 1)) - 1
    return bias + 1 if encoding == "finite-unsigned-zero" else bias


def binary(
    exponent_bits: int, fraction_bits: int, *, bias: int | None = None, encoding: str = "ieee"
) -> BinaryFormat:
    """A configured binary float format: sign | exponent | fraction, width 1 + e + f."""
    if not isinstance(exponent_bits, int) or exponent_bits < 2:
        raise FormatError(f"exponent_bits must be an integer >= 2, got {exponent_bits!r}")
    if encoding not in ENCODINGS:
        raise FormatError(f"unknown encoding {encoding!r}; known: {', '.join(ENCODINGS)}")
    if bias is None:
        bias = default_bias(exponent_bits, encoding)
    return BinaryFormat(exponent_bits, fraction_bits, bias, encoding)


def complex_of(component: ScalarFormat | str) -> ComplexFormat:
    """The complex format whose coordinates are ``component`` values."""
    if isinstance(component, str):
        component = get(component)
    return ComplexFormat(component)


def from_config(config: Any) -> ScalarFormat:
    """Inverse of :meth:`ScalarFormat.to_config`; rejects anything malformed with FormatError."""
    if not isinstance(config, dict) or not isinstance(config.get("kind"), str):
        raise FormatError(f"a format config must be a dict with a 'kind', got {config!r:.120}")
    kind = config["kind"]
    try:
        if kind == "binary":
            keys = ("exponent_bits", "fraction_bits", "bias", "encoding")
            return BinaryFormat(*(config[k] for k in keys))
        if kind == "exponent":
            return ExponentFormat(config["exponent_bits"], config["bias"])
        if kind == "int":
            return IntegerFormat(config["bits"], config["signed"])
        if kind == "bool":
            return BoolFormat()
        if kind == "complex":
            return ComplexFormat(from_config(config["component"]))
    except KeyError as exc:
        raise FormatError(f"format config {config!r:.120} lacks {exc}") from None
    raise FormatError(f"unknown format kind {kind!r}")


def of_numpy_dtype(dtype: Any) -> ScalarFormat:
    """The format of a numpy / ml_dtypes dtype; raises FormatError for anything else."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise FormatError(f"not a numpy dtype: {dtype!r}") from None
    fmt = _FORMAT_OF_DTYPE.get(dtype.newbyteorder("=") if dtype.byteorder == ">" else dtype)
    if fmt is None:
        raise FormatError(f"numpy dtype {dtype} has no lean_store format")
    return fmt
