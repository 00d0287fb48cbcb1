"""Scalar formats, codecs, packing, ``Encoded`` and ``Layout``.

The code-point tests are exhaustive for every format of 16 bits or fewer: each code is decoded
by lean_store (both the ml_dtypes path and the gfloat path) and by a pure-Python reference
decoder written below from the definition in docs/FORMAT.md, and must agree bit-for-bit.
Rounding is checked against a reference that finds the nearest value in the exhaustive table
of the format, with exact (Fraction) tie detection.
"""

from __future__ import annotations

import bisect
import json
import math
from fractions import Fraction
from functools import cache

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lean_store import formats as F
from lean_store.encoded import Encoded
from lean_store.errors import FormatError, LayoutError
from lean_store.formats.codecs import decode_generic, encode_generic
from lean_store.layout import Difference, Entry, Layout

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------------------------
# Expected registry contents, written out by hand
# --------------------------------------------------------------------------------------------

# tag: (width, numpy dtype or None, storage dtype, torchlean tag)
STANDARD_TABLE = {
    "float64": (64, np.float64, np.uint64, "torchlean_state_bits_v1"),
    "float32": (32, np.float32, np.uint32, "torchlean_state_float32_bits_v1"),
    "float16": (16, np.float16, np.uint16, "torchlean_state_binary_5_10_15_ieee_v1"),
    "bfloat16": (16, ml_dtypes.bfloat16, np.uint16, "torchlean_state_binary_8_7_127_ieee_v1"),
    "float8_e4m3fn": (
        8,
        ml_dtypes.float8_e4m3fn,
        np.uint8,
        "torchlean_state_binary_4_3_7_finite-max-nan_v1",
    ),
    "float8_e4m3fnuz": (
        8,
        ml_dtypes.float8_e4m3fnuz,
        np.uint8,
        "torchlean_state_binary_4_3_8_finite-unsigned-zero_v1",
    ),
    "float8_e5m2": (8, ml_dtypes.float8_e5m2, np.uint8, "torchlean_state_binary_5_2_15_ieee_v1"),
    "float8_e5m2fnuz": (
        8,
        ml_dtypes.float8_e5m2fnuz,
        np.uint8,
        "torchlean_state_binary_5_2_16_finite-unsigned-zero_v1",
    ),
    "float8_e4m3": (8, ml_dtypes.float8_e4m3, np.uint8, "torchlean_state_binary_4_3_7_ieee_v1"),
    "float8_e3m4": (8, ml_dtypes.float8_e3m4, np.uint8, "torchlean_state_binary_3_4_3_ieee_v1"),
    "float6_e2m3fn": (
        6,
        ml_dtypes.float6_e2m3fn,
        np.uint8,
        "torchlean_state_binary_2_3_1_finite_v1",
    ),
    "float6_e3m2fn": (
        6,
        ml_dtypes.float6_e3m2fn,
        np.uint8,
        "torchlean_state_binary_3_2_3_finite_v1",
    ),
    "float4_e2m1fn": (
        4,
        ml_dtypes.float4_e2m1fn,
        np.uint8,
        "torchlean_state_binary_2_1_1_finite_v1",
    ),
    "float8_e8m0fnu": (8, ml_dtypes.float8_e8m0fnu, np.uint8, None),
    "int8": (8, np.int8, np.uint8, None),
    "uint8": (8, np.uint8, np.uint8, None),
    "int16": (16, np.int16, np.uint16, None),
    "uint16": (16, np.uint16, np.uint16, None),
    "int32": (32, np.int32, np.uint32, None),
    "uint32": (32, np.uint32, np.uint32, None),
    "int64": (64, np.int64, np.uint64, None),
    "uint64": (64, np.uint64, np.uint64, None),
    "bool": (8, np.bool_, np.uint8, None),
    "complex64": (
        64,
        np.complex64,
        np.uint32,
        "torchlean_state_complex_v1(torchlean_state_float32_bits_v1)",
    ),
    "complex128": (
        128,
        np.complex128,
        np.uint64,
        "torchlean_state_complex_v1(torchlean_state_bits_v1)",
    ),
}

# tag: (exponent bits, fraction bits, bias, encoding) of the standard binary formats
STANDARD_BINARY = {
    "float64": (11, 52, 1023, "ieee"),
    "float32": (8, 23, 127, "ieee"),
    "float16": (5, 10, 15, "ieee"),
    "bfloat16": (8, 7, 127, "ieee"),
    "float8_e4m3fn": (4, 3, 7, "finite-max-nan"),
    "float8_e4m3fnuz": (4, 3, 8, "finite-unsigned-zero"),
    "float8_e5m2": (5, 2, 15, "ieee"),
    "float8_e5m2fnuz": (5, 2, 16, "finite-unsigned-zero"),
    "float8_e4m3": (4, 3, 7, "ieee"),
    "float8_e3m4": (3, 4, 3, "ieee"),
    "float6_e2m3fn": (2, 3, 1, "finite"),
    "float6_e3m2fn": (3, 2, 3, "finite"),
    "float4_e2m1fn": (2, 1, 1, "finite"),
}

# Largest finite value of each standard small float, from the OCP / vendor specifications.
STANDARD_MAX = {
    "float16": 65504.0,
    "bfloat16": float.fromhex("0x1.fep127"),
    "float8_e4m3fn": 448.0,
    "float8_e4m3fnuz": 240.0,
    "float8_e5m2": 57344.0,
    "float8_e5m2fnuz": 57344.0,
    "float8_e4m3": 240.0,
    "float8_e3m4": 15.5,
    "float6_e2m3fn": 7.5,
    "float6_e3m2fn": 28.0,
    "float4_e2m1fn": 6.0,
}

SMALL_STANDARD = list(STANDARD_MAX)  # every standard binary float of 16 bits or fewer

# Configured formats (no ml_dtypes type): every encoding, odd widths, extreme biases.
CONFIGURED = [
    F.binary(5, 6),  # 12-bit ieee
    F.binary(3, 2, encoding="finite-max-nan"),
    F.binary(6, 9, encoding="finite-unsigned-zero"),  # 16 bits
    F.binary(2, 1, encoding="ieee"),
    F.binary(7, 8, bias=10, encoding="finite"),  # 16 bits, max near 2**117
    F.binary(4, 3, bias=8),  # e4m3 layout, ieee, non-default bias
    F.binary(2, 1, encoding="finite-unsigned-zero"),
    F.binary(2, 1, encoding="finite-max-nan"),
    F.binary(3, 3, bias=0, encoding="finite"),
    F.binary(3, 3, bias=7, encoding="finite-max-nan"),  # largest bias for 3 exponent bits
    F.binary(4, 11),  # 16-bit ieee with a long fraction
    F.binary(2, 13, encoding="finite-unsigned-zero"),
]

ALL_SMALL_BINARY = [F.get(name) for name in SMALL_STANDARD] + CONFIGURED


def fid(fmt: F.ScalarFormat) -> str:
    return fmt.tag


# --------------------------------------------------------------------------------------------
# Independent reference: value of a code point, straight from the definition
# --------------------------------------------------------------------------------------------


def magnitude(code: int, e: int, f: int, bias: int) -> float:
    """|value| of sign-less ``code`` ignoring specials; the exponent field may overflow e bits."""
    exp_field, frac = code >> f, code & ((1 << f) - 1)
    if exp_field == 0:
        return math.ldexp(frac, 1 - bias - f)  # subnormal: 0.frac * 2^(1 - bias)
    return math.ldexp((1 << f) | frac, exp_field - bias - f)  # normal: 1.frac * 2^(E - bias)


def ref_value(code: int, e: int, f: int, bias: int, enc: str) -> float:
    negative = bool(code >> (e + f))
    body = code & ((1 << (e + f)) - 1)
    exp_field, frac = body >> f, body & ((1 << f) - 1)
    all_ones = (1 << e) - 1
    if enc == "ieee" and exp_field == all_ones:
        value = math.inf if frac == 0 else math.nan
    elif enc == "finite-max-nan" and exp_field == all_ones and frac == (1 << f) - 1:
        value = math.nan
    elif enc == "finite-unsigned-zero" and negative and body == 0:
        return math.nan
    else:
        value = magnitude(body, e, f, bias)
    return -value if negative else value


def params(fmt: F.BinaryFormat) -> tuple[int, int, int, str]:
    return fmt.exponent_bits, fmt.fraction_bits, fmt.bias, fmt.encoding


@cache
def ref_table(fmt: F.BinaryFormat) -> np.ndarray:
    e, f, bias, enc = params(fmt)
    return np.array([ref_value(c, e, f, bias, enc) for c in range(1 << fmt.width)])


def all_codes(fmt: F.ScalarFormat) -> np.ndarray:
    return np.arange(1 << fmt.width, dtype=np.uint64).astype(fmt.storage_dtype)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as float64 bit patterns, with every NaN equal to every NaN."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or not np.array_equal(np.isnan(a), np.isnan(b)):
        return False
    keep = ~np.isnan(a)
    return np.array_equal(a[keep].view(np.uint64), b[keep].view(np.uint64))


def is_nan_code(fmt: F.ScalarFormat, codes: np.ndarray) -> np.ndarray:
    return np.isnan(fmt.decode(codes))


# --------------------------------------------------------------------------------------------
# Independent reference: round-to-nearest-even into a format, by search of its code table
# --------------------------------------------------------------------------------------------

NAN, ERROR = "nan", "error"


@cache
def rounding_table(fmt: F.BinaryFormat) -> tuple[list[float], int]:
    """Magnitudes of the codes 0 .. max_code + 1 (the last one is the first value past the
    largest finite one, as if the exponent were unbounded), and max_code."""
    e, f, bias, enc = params(fmt)
    table = ref_table(fmt)
    positive = table[: 1 << (fmt.width - 1)]
    max_code = int(np.flatnonzero(np.isfinite(positive))[-1])
    assert np.isfinite(positive[: max_code + 1]).all()  # finite codes are 0 .. max_code
    mags = [magnitude(c, e, f, bias) for c in range(max_code + 2)]
    assert mags[: max_code + 1] == positive[: max_code + 1].tolist()
    assert all(a < b for a, b in zip(mags, mags[1:]))
    return mags, max_code


def ref_encode(fmt: F.BinaryFormat, x: float) -> int | str:
    """Expected code of ``x``: NAN when any NaN code is right, ERROR when encode must raise."""
    e, f, _, enc = params(fmt)
    mags, max_code = rounding_table(fmt)
    if math.isnan(x):
        return ERROR if enc == "finite" else NAN
    negative = math.copysign(1.0, x) < 0
    a = abs(x)
    i = bisect.bisect_left(mags, a)
    if i == len(mags):
        code = max_code + 1  # beyond the first unrepresentable value (or infinite)
    elif mags[i] == a:
        code = i
    else:
        below, above = Fraction(a) - Fraction(mags[i - 1]), Fraction(mags[i]) - Fraction(a)
        if below != above:
            code = i - 1 if below < above else i
        else:
            code = i - 1 if (i - 1) % 2 == 0 else i  # tie: the even code
    if code > max_code:  # overflow
        if enc == "ieee":
            code = ((1 << e) - 1) << f
        elif enc == "finite":
            code = max_code
        else:
            return NAN
    if negative and not (enc == "finite-unsigned-zero" and code == 0):
        code |= 1 << (fmt.width - 1)
    return code


def check_against_reference(fmt: F.BinaryFormat, xs: list[float], got: np.ndarray) -> None:
    for x, g in zip(xs, got.tolist()):
        want = ref_encode(fmt, x)
        assert want != ERROR
        if want == NAN:
            assert math.isnan(ref_table(fmt)[g]), (fmt.tag, x, g)
        else:
            assert g == want, (fmt.tag, x.hex() if isinstance(x, float) else x, g, want)


# ============================================================================================
# Registry: tags, widths, dtypes
# ============================================================================================


def test_standard_table_is_complete():
    assert list(F.STANDARD) == list(STANDARD_TABLE)
    small = [t for t, f in F.STANDARD.items() if isinstance(f, F.BinaryFormat) and f.width <= 16]
    assert sorted(small) == sorted(SMALL_STANDARD)
    assert all(fmt.numpy_dtype is None for fmt in CONFIGURED)


@pytest.mark.parametrize("tag", list(STANDARD_TABLE))
def test_standard_tag_properties(tag):
    width, np_dtype, storage, torchlean = STANDARD_TABLE[tag]
    fmt = F.get(tag)
    assert fmt == F.STANDARD[tag]
    assert fmt.tag == tag and str(fmt) == tag and tag in repr(fmt)
    assert fmt.width == width
    assert fmt.numpy_dtype == np.dtype(np_dtype)
    assert fmt.storage_dtype == np.dtype(storage)
    assert fmt.torchlean_tag == torchlean
    assert F.of_numpy_dtype(np_dtype) == fmt
    assert F.from_config(json.loads(json.dumps(fmt.to_config()))) == fmt
    if tag in STANDARD_BINARY:
        assert params(fmt) == STANDARD_BINARY[tag]


def test_of_numpy_dtype_big_endian_and_unknown():
    assert F.of_numpy_dtype(">f4") == F.get("float32")
    assert F.of_numpy_dtype(np.dtype(">c16")) == F.get("complex128")
    for bad in ("U3", np.dtype([("a", "f4")]), "not-a-dtype"):
        with pytest.raises(FormatError):
            F.of_numpy_dtype(bad)


def test_configured_format_properties():
    cbf = F.complex_of(F.get("bfloat16"))
    assert cbf.tag == "complex(bfloat16)"
    assert (cbf.width, cbf.word_width, cbf.words_per_value) == (32, 16, 2)
    assert cbf.storage_dtype == np.uint16 and cbf.numpy_dtype is None
    assert cbf.torchlean_tag == "torchlean_state_complex_v1(torchlean_state_binary_8_7_127_ieee_v1)"

    b12 = F.binary(5, 6)
    assert b12.tag == "binary_5_6_15_ieee"
    assert (b12.width, b12.storage_dtype, b12.numpy_dtype) == (12, np.uint16, None)
    assert b12.torchlean_tag == "torchlean_state_binary_5_6_15_ieee_v1"
    assert F.get("binary_5_6_15_ieee") == b12

    assert F.get("float6_e2m3fn").storage_dtype == np.uint8
    assert F.binary(8, 14).storage_dtype == np.uint32  # 23 bits
    assert F.binary(11, 40).storage_dtype == np.uint64  # 52 bits
    assert F.binary(2, 61).width == 64
    c = F.get("complex(binary_5_6_15_ieee)")
    assert c == F.complex_of(b12) and c.width == 24 and c.storage_dtype == np.uint16
    assert c.torchlean_tag == "torchlean_state_complex_v1(torchlean_state_binary_5_6_15_ieee_v1)"


def test_unknown_tag_names_tag_and_lists_known():
    with pytest.raises(FormatError) as info:
        F.get("float7_e3m3")
    message = str(info.value)
    assert "float7_e3m3" in message
    for known in ("float32", "bfloat16", "float8_e4m3fn", "int8", "bool", "complex64"):
        assert known in message
    assert "binary_E_F_BIAS_ENCODING" in message


@pytest.mark.parametrize(
    "tag",
    [
        "",
        "Float32",
        "float32 ",
        "binary_5_6_15_bogus",
        "binary_5_6_15",
        "binary_5_6_-1_ieee",  # bias out of range
        "binary_1_6_0_ieee",  # e < 2
        "binary_5_0_15_ieee",  # f < 1
        "binary_12_52_1023_ieee",  # 65 bits
        "complex(int8)",
        "complex(float8_e8m0fnu)",
        "complex(complex64)",
        "complex(nope)",
        "complex()",
    ],
)
def test_bad_tags_raise(tag):
    with pytest.raises(FormatError):
        F.get(tag)


def test_get_rejects_non_strings():
    for bad in (None, 32, b"float32", F.get("float32")):
        with pytest.raises(FormatError):
            F.get(bad)


# ============================================================================================
# Canonicalization and equality
# ============================================================================================


@pytest.mark.parametrize(
    "fmt, tag",
    [
        (F.binary(8, 7), "bfloat16"),
        (F.binary(5, 10), "float16"),
        (F.binary(8, 23), "float32"),
        (F.binary(11, 52), "float64"),
        (F.binary(4, 3, encoding="finite-max-nan"), "float8_e4m3fn"),
        (F.binary(4, 3, encoding="finite-unsigned-zero"), "float8_e4m3fnuz"),
        (F.binary(5, 2, encoding="finite-unsigned-zero"), "float8_e5m2fnuz"),
        (F.binary(5, 2), "float8_e5m2"),
        (F.binary(4, 3), "float8_e4m3"),
        (F.binary(3, 4), "float8_e3m4"),
        (F.binary(2, 3, encoding="finite"), "float6_e2m3fn"),
        (F.binary(3, 2, encoding="finite"), "float6_e3m2fn"),
        (F.binary(2, 1, encoding="finite"), "float4_e2m1fn"),
        (F.binary(8, 7, bias=127, encoding="ieee"), "bfloat16"),
        (F.BinaryFormat(8, 7, 127, "ieee"), "bfloat16"),
        (F.complex_of(F.get("float32")), "complex64"),
        (F.complex_of(F.get("float64")), "complex128"),
        (F.complex_of("float32"), "complex64"),
        (F.complex_of(F.binary(8, 7)), "complex(bfloat16)"),
        (F.get("binary_8_7_127_ieee"), "bfloat16"),
        (F.get("complex(float32)"), "complex64"),
        (F.get("complex(binary_8_23_127_ieee)"), "complex64"),
    ],
)
def test_canonical_forms(fmt, tag):
    assert fmt == F.get(tag)
    assert hash(fmt) == hash(F.get(tag))
    assert fmt.tag == tag


def test_default_biases():
    assert F.binary(4, 3, encoding="finite-unsigned-zero").bias == 8
    assert F.binary(5, 2, encoding="finite-unsigned-zero").bias == 16
    for enc in ("ieee", "finite-max-nan", "finite"):
        assert F.binary(4, 3, encoding=enc).bias == 7
    assert F.default_bias(11, "ieee") == 1023
    assert F.default_bias(2, "finite-unsigned-zero") == 2


@st.composite
def binary_params(draw):
    e = draw(st.integers(2, 62))
    f = draw(st.integers(1, 63 - e))
    bias = draw(st.one_of(st.integers(0, (1 << e) - 1), st.sampled_from([0, (1 << e) - 1])))
    enc = draw(st.sampled_from(F.ENCODINGS))
    return e, f, bias, enc


@SETTINGS
@given(binary_params())
def test_tag_and_config_round_trip(p):
    e, f, bias, enc = p
    fmt = F.binary(e, f, bias=bias, encoding=enc)
    assert fmt == F.BinaryFormat(e, f, bias, enc)
    assert params(fmt) == p and fmt.width == 1 + e + f
    standard = [name for name, q in STANDARD_BINARY.items() if q == p]
    assert fmt.tag == (standard[0] if standard else f"binary_{e}_{f}_{bias}_{enc}")
    for g in (fmt, F.complex_of(fmt)):
        again = F.get(g.tag)
        assert again == g and hash(again) == hash(g) and again.tag == g.tag
        config = json.loads(json.dumps(g.to_config()))
        assert F.from_config(config) == g and hash(F.from_config(config)) == hash(g)


def test_same_width_different_meaning_is_unequal():
    variants = [
        F.binary(4, 3),
        F.binary(4, 3, bias=8),
        F.binary(4, 3, encoding="finite"),
        F.binary(4, 3, encoding="finite-max-nan"),
        F.binary(4, 3, encoding="finite-unsigned-zero"),
        F.binary(4, 3, bias=8, encoding="finite"),
        F.binary(3, 4),
        F.binary(5, 2),
        F.get("float8_e8m0fnu"),
        F.get("int8"),
        F.get("uint8"),
        F.get("bool"),
    ]
    assert all(v.width == 8 for v in variants)
    assert len(set(variants)) == len(variants)
    assert len({v.tag for v in variants}) == len(variants)
    assert len({F.complex_of(v).tag for v in variants[:8]}) == 8
    assert F.complex_of(F.binary(4, 3)) != F.complex_of(F.binary(4, 3, bias=8))


@pytest.mark.parametrize(
    "make",
    [
        lambda: F.binary(1, 3),
        lambda: F.binary(0, 3),
        lambda: F.binary(-2, 3),
        lambda: F.binary(4, 0),
        lambda: F.binary(4, -1),
        lambda: F.binary(12, 52),  # 65 bits
        lambda: F.binary(2, 62),
        lambda: F.binary(4, 3, bias=-1),
        lambda: F.binary(4, 3, bias=16),
        lambda: F.binary(4, 3, encoding="IEEE"),
        lambda: F.binary(4, 3, encoding="fnuz"),
        lambda: F.binary(4.0, 3),
        lambda: F.binary(4, 3.0),
        lambda: F.binary("4", 3),
        lambda: F.binary(4, 3, bias=7.0),
        lambda: F.binary(4, True),
        lambda: F.binary(4, 3, bias=True),
        lambda: F.binary(None, 3),
        lambda: F.BinaryFormat(4, 3, 7, "nope"),
        lambda: F.BinaryFormat(1, 3, 0, "ieee"),
        lambda: F.ExponentFormat(8, 100),
        lambda: F.IntegerFormat(12, True),
        lambda: F.IntegerFormat(8, 1),
        lambda: F.ComplexFormat(F.get("int8")),
        lambda: F.ComplexFormat(F.get("bool")),
        lambda: F.ComplexFormat(F.get("complex64")),
        lambda: F.complex_of("float8_e8m0fnu"),
        lambda: F.complex_of("nope"),
    ],
)
def test_impossible_formats_raise(make):
    with pytest.raises(FormatError):
        make()


@pytest.mark.parametrize(
    "config",
    [
        None,
        [],
        "float32",
        {},
        {"kind": 3},
        {"kind": "float"},
        {"kind": "binary"},
        {"kind": "binary", "exponent_bits": 4, "fraction_bits": 3, "bias": 7},
        {"kind": "binary", "exponent_bits": 4, "fraction_bits": 3, "bias": 7, "encoding": "x"},
        {"kind": "binary", "exponent_bits": "4", "fraction_bits": 3, "bias": 7, "encoding": "ieee"},
        {"kind": "binary", "exponent_bits": 4, "fraction_bits": 3, "bias": 99, "encoding": "ieee"},
        {"kind": "binary", "exponent_bits": 40, "fraction_bits": 30, "bias": 0, "encoding": "ieee"},
        {"kind": "exponent", "exponent_bits": 8},
        {"kind": "exponent", "exponent_bits": 7, "bias": 63},
        {"kind": "int", "bits": 8},
        {"kind": "int", "bits": 24, "signed": True},
        {"kind": "int", "bits": 8, "signed": "yes"},
        {"kind": "complex"},
        {"kind": "complex", "component": "float32"},
        {"kind": "complex", "component": {"kind": "int", "bits": 8, "signed": True}},
        {"kind": "complex", "component": {"kind": "complex", "component": {"kind": "bool"}}},
    ],
)
def test_from_config_rejects_malformed(config):
    with pytest.raises(FormatError):
        F.from_config(config)


# ============================================================================================
# Exhaustive code points
# ============================================================================================


@pytest.mark.parametrize("fmt", ALL_SMALL_BINARY, ids=fid)
def test_every_code_point_decodes_to_the_definition(fmt):
    codes = all_codes(fmt)
    want = ref_table(fmt)
    assert same_bits(fmt.decode(codes), want)
    assert same_bits(decode_generic(fmt, codes), want)
    if fmt.numpy_dtype is not None:
        with np.errstate(invalid="ignore"):
            ml = codes.view(fmt.numpy_dtype).astype(np.float64)
        assert same_bits(ml, want)
    else:
        assert fmt in CONFIGURED

    # Specials per encoding.
    e, f, _, enc = params(fmt)
    n_nan, n_inf = int(np.isnan(want).sum()), int(np.isinf(want).sum())
    assert (n_nan, n_inf) == {
        "ieee": (2 * ((1 << f) - 1), 2),
        "finite-max-nan": (2, 0),
        "finite-unsigned-zero": (1, 0),
        "finite": (0, 0),
    }[enc]
    zeros = codes[want == 0]
    assert len(zeros) == (1 if enc == "finite-unsigned-zero" else 2)
    assert not np.signbit(want[zeros[0]])
    finite = want[np.isfinite(want)]
    if fmt.tag in STANDARD_MAX:
        assert finite.max() == STANDARD_MAX[fmt.tag] == -finite.min()


@pytest.mark.parametrize("fmt", ALL_SMALL_BINARY, ids=fid)
def test_every_code_point_round_trips(fmt):
    codes = all_codes(fmt)
    values = fmt.decode(codes)
    nan = np.isnan(values)
    for encode in (fmt.encode, lambda v: encode_generic(fmt, v)):
        assert np.array_equal(encode(values[~nan]), codes[~nan])
        if nan.any():
            assert is_nan_code(fmt, encode(values[nan])).all()
    if fmt.numpy_dtype is not None and nan.any():
        # Both paths write the same NaN code for a NaN of either sign.
        signed = np.array([np.nan, -np.nan, np.inf, -np.inf, 1e300, -1e300])
        assert np.array_equal(fmt.encode(signed), encode_generic(fmt, signed))


def test_fnuz_has_no_negative_zero():
    for tag in ("float8_e4m3fnuz", "float8_e5m2fnuz"):
        fmt = F.get(tag)
        assert np.isnan(fmt.decode(np.array([0x80], np.uint8)))[0]
        assert fmt.encode(np.array([-0.0, -1e-300, 0.0])).tolist() == [0, 0, 0]
        assert fmt.encode(np.array([np.nan, -np.nan])).tolist() == [0x80, 0x80]


def test_e8m0_every_code_point():
    fmt = F.get("float8_e8m0fnu")
    codes = all_codes(fmt)
    want = np.array([math.nan if c == 255 else math.ldexp(1.0, c - 127) for c in range(256)])
    assert same_bits(fmt.decode(codes), want)
    assert np.array_equal(fmt.encode(want[:255]), codes[:255])
    assert fmt.encode(np.array([np.nan])).tolist() == [255]
    assert fmt.width == 8 and fmt.torchlean_tag is None


@pytest.mark.parametrize("tag", ["int8", "uint8", "int16", "uint16"])
def test_every_integer_code_point(tag):
    fmt = F.get(tag)
    width, signed = fmt.width, tag.startswith("int")
    codes = all_codes(fmt)
    want = [c - (1 << width) if signed and c >> (width - 1) else c for c in range(1 << width)]
    got = fmt.decode(codes)
    assert got.dtype == fmt.numpy_dtype and got.tolist() == want
    assert np.array_equal(fmt.encode(got), codes)
    assert np.array_equal(fmt.encode(want), codes)  # from Python ints
    assert np.array_equal(fmt.encode(np.array(want, dtype=np.float64)), codes)


def test_every_bool_code_point():
    fmt = F.get("bool")
    assert fmt.decode(np.array([0, 1], np.uint8)).tolist() == [False, True]
    for bad in range(2, 256):
        with pytest.raises(FormatError):
            fmt.decode(np.array([0, bad], np.uint8))
    assert fmt.encode([True, False]).tolist() == [1, 0]
    assert fmt.encode([0, 1]).tolist() == [0, 1]
    assert fmt.encode(np.array([0.0, 1.0])).tolist() == [0, 1]
    for bad in ([2], [-1], [0.5], [np.nan]):
        with pytest.raises(FormatError):
            fmt.encode(bad)


# ============================================================================================
# Rounding
# ============================================================================================


@pytest.mark.parametrize("fmt", ALL_SMALL_BINARY, ids=fid)
def test_every_tie_and_its_neighbours(fmt):
    """All midpoints between adjacent magnitudes (also between the largest finite value and the
    first value past it), exactly and one float64 / float32 step either side, both signs."""
    e, f, _, enc = params(fmt)
    mags, max_code = rounding_table(fmt)
    m = np.array(mags)
    lo, hi = np.arange(max_code + 1), np.arange(1, max_code + 2)
    mid = (m[:-1] + m[1:]) / 2  # exact: a small format's midpoint has few significant bits
    assert np.array_equal(mid * 2 - m[:-1], m[1:])
    even = np.where(lo % 2 == 0, lo, hi)
    mid32 = mid.astype(np.float32)
    ok32 = np.isfinite(mid32) & (mid32.astype(np.float64) == mid)
    up32 = np.nextafter(mid32, np.float32(np.inf))[ok32].astype(np.float64)
    down32 = np.nextafter(mid32, np.float32(0))[ok32].astype(np.float64)
    # (inputs, expected magnitude codes, whether ml_dtypes rounds these once)
    cases = [
        (mid, even, True),
        (np.nextafter(mid, np.inf), hi, False),
        (np.nextafter(mid, 0), lo, False),
        (up32, hi[ok32], True),
        (down32, lo[ok32], True),
    ]
    sign = np.uint64(1 << (fmt.width - 1))
    for x, want, ml_exact in cases:
        want = want.astype(np.uint64)
        over = want > max_code
        nan_expected = over & (enc in ("finite-max-nan", "finite-unsigned-zero"))
        if enc == "finite":
            want[over] = max_code
        elif enc == "ieee":
            want[over] = ((1 << e) - 1) << f
        negative_zero_ok = enc != "finite-unsigned-zero"
        for xs, expected in (
            (x, want),
            (-x, np.where((want == 0) & (not negative_zero_ok), want, want | sign)),
        ):
            results = [fmt.encode(xs), encode_generic(fmt, xs)]
            if fmt.numpy_dtype is not None and ml_exact:
                with np.errstate(over="ignore", invalid="ignore"):
                    results.append(xs.astype(fmt.numpy_dtype).view(fmt.storage_dtype))
            for got in results:
                assert np.array_equal(got[~nan_expected], expected[~nan_expected]), fmt.tag
                assert is_nan_code(fmt, got[nan_expected]).all()


def value_strategy(fmt: F.BinaryFormat):
    mags, max_code = rounding_table(fmt)
    top, tiny = mags[-1], mags[1]

    def near_tie(args):
        code, steps, negative, in_float32 = args
        x = (mags[code] + mags[code + 1]) / 2
        if in_float32:
            x32 = np.float32(x)
            toward = np.float32(np.inf if steps > 0 else 0)
            for _ in range(abs(steps)):
                x32 = np.nextafter(x32, toward)
            x = float(x32)
        else:
            for _ in range(abs(steps)):
                x = math.nextafter(x, math.inf if steps > 0 else 0.0)
        return -x if negative else x

    return st.lists(
        st.one_of(
            st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
            st.floats(min_value=-2 * top, max_value=2 * top),
            st.floats(min_value=-4 * tiny, max_value=4 * tiny),
            st.tuples(
                st.integers(0, max_code), st.integers(-3, 3), st.booleans(), st.booleans()
            ).map(near_tie),
        ),
        min_size=1,
        max_size=24,
    )


def assert_same_codes(fmt, got, want):
    nan = is_nan_code(fmt, want)
    assert np.array_equal(is_nan_code(fmt, got), nan)
    assert np.array_equal(got[~nan], want[~nan])


@pytest.mark.parametrize("tag", SMALL_STANDARD)
@SETTINGS
@given(data=st.data())
def test_encode_standard_matches_ml_dtypes_and_reference(tag, data):
    fmt = F.get(tag)
    xs = data.draw(value_strategy(fmt))
    arr = np.array(xs, dtype=np.float64)
    if fmt.encoding == "finite" and np.isnan(arr).any():
        with pytest.raises(FormatError):
            fmt.encode(arr)
        arr = arr[~np.isnan(arr)]
        xs = arr.tolist()
    got = fmt.encode(arr)
    assert got.dtype == fmt.storage_dtype and got.shape == arr.shape
    with np.errstate(over="ignore", invalid="ignore"):
        ml = arr.astype(fmt.numpy_dtype).view(fmt.storage_dtype)
        exact32 = (arr.astype(np.float32).astype(np.float64) == arr) | np.isnan(arr)
    # ml_dtypes is the reference wherever it rounds once: inputs float32 holds exactly
    # (numpy's float16 cast rounds once everywhere).
    assert np.array_equal(got[exact32], ml[exact32]) or tag == "float16"
    if tag == "float16":
        assert np.array_equal(got, ml)
    assert_same_codes(fmt, encode_generic(fmt, arr), got)
    check_against_reference(fmt, xs, got)


@pytest.mark.parametrize("fmt", CONFIGURED, ids=fid)
@SETTINGS
@given(data=st.data())
def test_encode_configured_is_nearest_even(fmt, data):
    xs = data.draw(value_strategy(fmt))
    arr = np.array(xs, dtype=np.float64)
    if fmt.encoding == "finite" and np.isnan(arr).any():
        with pytest.raises(FormatError):
            fmt.encode(arr)
        arr = arr[~np.isnan(arr)]
        xs = arr.tolist()
    got = fmt.encode(arr)
    assert got.dtype == fmt.storage_dtype and got.shape == arr.shape
    check_against_reference(fmt, xs, got)


def test_float64_is_rounded_once_not_through_float32():
    """ml_dtypes before 0.7 cast float64 through float32 (0.7 rounds once); encode must round
    the float64 value once with every ml_dtypes the project allows."""
    bf16 = F.get("bfloat16")
    x = math.nextafter(1 + 2**-8, 2.0)  # just above the tie between 1 and 1 + 2**-7
    # through float32 it lands on the tie itself, which rounds to even (0x3F80): wrong
    assert float(np.float32(x)) == 1 + 2**-8
    assert bf16.encode(np.array([x])).tolist() == [0x3F81]
    assert bf16.encode(np.array([1 + 2**-8])).tolist() == [0x3F80]  # tie to even


def test_overflow_rules():
    cases = [
        # (format, inputs, expected codes); None means any NaN code
        (
            F.get("float8_e5m2"),
            [57344.0, 61439.9, 61440.0, 1e300, np.inf],
            [123, 123, 124, 124, 124],
        ),
        (F.get("float8_e4m3fn"), [448.0, 464.0, 464.01, np.inf], [126, 126, None, None]),
        (F.get("float8_e4m3fnuz"), [240.0, 247.9, 248.0, -np.inf], [127, 127, None, None]),
        (F.get("float4_e2m1fn"), [6.0, 7.0, 1e300, np.inf, -np.inf], [7, 7, 7, 7, 15]),
        (F.binary(5, 6), [65024.0, 65279.0, 65280.0, -1e10], [0x7BF, 0x7BF, 0x7C0, 0xFC0]),
        (F.binary(3, 2, encoding="finite-max-nan"), [24.0, 26.0, 26.01], [30, 30, None]),
        (F.binary(7, 8, bias=10, encoding="finite"), [np.inf, -1e300], [0x7FFF, 0xFFFF]),
    ]
    for fmt, xs, want in cases:
        got = fmt.encode(np.array(xs))
        for x, g, w in zip(xs, got.tolist(), want):
            if w is None:
                assert math.isnan(fmt.decode(np.array([g]))[0]), (fmt.tag, x)
            else:
                assert g == w, (fmt.tag, x, g, w)


def test_signed_zero_and_underflow():
    finite = F.binary(3, 3, bias=0, encoding="finite")
    for fmt in (F.get("bfloat16"), F.get("float8_e4m3fn"), F.binary(5, 6), finite):
        sign = 1 << (fmt.width - 1)
        got = fmt.encode(np.array([0.0, -0.0, 5e-324, -5e-324, -1e-300]))
        assert got.tolist() == [0, sign, 0, sign, sign]


@pytest.mark.parametrize(
    "fmt",
    [
        F.get("float4_e2m1fn"),
        F.get("float6_e2m3fn"),
        F.get("float6_e3m2fn"),
        F.binary(7, 8, bias=10, encoding="finite"),
    ],
    ids=fid,
)
def test_nan_into_finite_format_raises(fmt):
    with pytest.raises(FormatError):
        fmt.encode(np.array([1.0, np.nan]))
    with pytest.raises(FormatError):
        F.complex_of(fmt).encode(np.array([complex(1.0, np.nan)]))


# ============================================================================================
# Integers, bool, complex
# ============================================================================================


def test_integer_encode_range_checks():
    cases = [
        ("int8", [128]),
        ("int8", [-129]),
        ("uint8", [-1]),
        ("uint8", [256]),
        ("int16", [40000]),
        ("uint16", [-1.0]),
        ("int32", [2.0**31]),
        ("uint32", [2**32]),
        ("int64", [2.0**63]),
        ("int64", [2**63]),
        ("uint64", [2.0**64]),
        ("uint64", [2**64]),
        ("uint64", np.array([-1], np.int64)),
        ("int64", np.array([2**63], np.uint64)),
        ("int8", [1.5]),
        ("int8", [np.nan]),
        ("int8", [np.inf]),
        ("int64", [-np.inf]),
    ]
    for tag, values in cases:
        with pytest.raises(FormatError):
            F.get(tag).encode(values)


def test_integer_extremes_are_exact():
    i64, u64 = F.get("int64"), F.get("uint64")
    extremes = np.array([-(2**63), 2**63 - 1, -1, 0], dtype=np.int64)
    bits = i64.encode(extremes)
    assert bits.dtype == np.uint64
    assert bits.tolist() == [2**63, 2**63 - 1, 2**64 - 1, 0]
    assert i64.decode(bits).tolist() == [-(2**63), 2**63 - 1, -1, 0]
    assert i64.encode([2**63 - 1, -(2**63)]).tolist() == [2**63 - 1, 2**63]
    assert i64.encode(np.array([-(2.0**63), 2.0**62])).view(np.int64).tolist() == [-(2**63), 2**62]
    assert u64.decode(np.array([2**64 - 1], np.uint64)).tolist() == [2**64 - 1]
    assert u64.encode([2**64 - 1]).tolist() == [2**64 - 1]
    for tag in ("int32", "uint32"):
        fmt = F.get(tag)
        info = np.iinfo(fmt.numpy_dtype)
        assert fmt.decode(fmt.encode([info.min, info.max])).tolist() == [info.min, info.max]


@pytest.mark.parametrize("tag", ["complex(bfloat16)", "complex64", "complex(binary_5_6_15_ieee)"])
def test_complex_round_trip_bit_exact(tag):
    fmt = F.get(tag)
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 1 << fmt.word_width, size=(50, 3, 2), dtype=np.uint64)
    bits = bits.astype(fmt.storage_dtype)
    values = fmt.decode(bits)
    assert values.dtype == np.complex128 and values.shape == (50, 3)
    keep = ~np.isnan(values.real) & ~np.isnan(values.imag)
    again = fmt.encode(values)
    assert again.shape == (50, 3, 2) and again.dtype == fmt.storage_dtype
    assert np.array_equal(again[keep], bits[keep])
    assert same_bits(values.real, fmt.component.decode(bits[..., 0]))
    assert same_bits(values.imag, fmt.component.decode(bits[..., 1]))


def test_complex64_bits_are_numpy_memory_layout():
    fmt = F.get("complex64")
    values = np.array([1 + 2j, -0.0 - 0.0j, complex(np.inf, -np.inf), 1e-45 + 3.5j], np.complex64)
    bits = fmt.encode(values)
    assert bits.shape == (4, 2) and bits.dtype == np.uint32
    assert np.array_equal(bits, values.view(np.uint32).reshape(4, 2))
    decoded = fmt.decode(bits)
    assert same_bits(decoded.real, values.real) and same_bits(decoded.imag, values.imag)
    with pytest.raises(FormatError):
        fmt.decode(np.zeros((4, 3), np.uint32))  # no trailing pair axis
    with pytest.raises(FormatError):
        fmt.decode(np.uint32(0))


# ============================================================================================
# Packing
# ============================================================================================

PACK_FORMATS = [
    F.get("float4_e2m1fn"),
    F.get("float6_e3m2fn"),
    F.binary(2, 2),  # 5 bits
    F.binary(3, 3),  # 7 bits
    F.get("float8_e4m3fn"),
    F.binary(5, 6),  # 12 bits
    F.binary(4, 11),  # 16 bits, configured
    F.get("bfloat16"),
    F.binary(8, 14),  # 23 bits
    F.get("float32"),
    F.binary(11, 40),  # 52 bits
    F.binary(2, 61),  # 64 bits, configured
    F.get("float64"),
    F.get("int8"),
    F.get("uint16"),
    F.get("int32"),
    F.get("uint64"),
    F.get("bool"),
    F.get("float8_e8m0fnu"),
    F.complex_of("float4_e2m1fn"),
    F.complex_of(F.binary(5, 6)),
    F.complex_of("bfloat16"),
    F.get("complex64"),
    F.get("complex128"),
]


@SETTINGS
@given(
    fmt=st.sampled_from(PACK_FORMATS),
    shape=st.lists(st.integers(0, 5), max_size=3),
    seed=st.integers(0, 2**32 - 1),
)
def test_pack_unpack_round_trip(fmt, shape, seed):
    shape = tuple(shape)
    full = shape + ((2,) if fmt.words_per_value == 2 else ())
    width = fmt.word_width
    rng = np.random.default_rng(seed)
    limit = 2 if isinstance(fmt, F.BoolFormat) else 1 << width
    bits = rng.integers(0, limit, size=full, dtype=np.uint64, endpoint=False)
    bits = bits.astype(fmt.storage_dtype)
    packed = F.pack(bits, fmt)
    count = math.prod(shape)
    assert packed.dtype == np.uint8 and packed.ndim == 1
    assert (
        packed.size
        == F.packed_nbytes(count, fmt)
        == math.ceil(count * fmt.words_per_value * width / 8)
    )
    # The stream is the words, little-endian, word i at bits [i*w, (i+1)*w).
    stream = sum(int(w) << (i * width) for i, w in enumerate(bits.reshape(-1).tolist()))
    assert int.from_bytes(packed.tobytes(), "little") == stream
    if width % 8 == 0:
        little = bits.astype(bits.dtype.newbyteorder("<"))
        assert packed.tobytes() == little.tobytes()
    out = F.unpack(packed, fmt, shape)
    assert out.dtype == fmt.storage_dtype and out.shape == full
    assert np.array_equal(out, bits)


def test_pack_examples():
    fp4 = F.get("float4_e2m1fn")
    assert F.pack(np.array([1, 2, 3], np.uint8), fp4).tolist() == [0x21, 0x03]
    assert F.unpack(np.array([0x21, 0x03], np.uint8), fp4, (3,)).tolist() == [1, 2, 3]

    b12 = F.binary(5, 6)
    assert F.pack(np.array([0xABC, 0x123], np.uint16), b12).tolist() == [0xBC, 0x3A, 0x12]
    words = np.arange(4096, dtype=np.uint16)
    packed = F.pack(words, b12)
    assert packed.size == 6144
    assert np.array_equal(F.unpack(packed, b12, (64, 64)), words.reshape(64, 64))

    fp6 = F.get("float6_e2m3fn")
    assert F.pack(np.array([0x3F, 0, 0x3F, 0], np.uint8), fp6).tolist() == [0x3F, 0xF0, 0x03]

    f32 = F.get("float32")
    assert F.pack(np.array([0x01020304], np.uint32), f32).tolist() == [4, 3, 2, 1]
    cbf = F.complex_of("bfloat16")
    assert F.pack(np.array([[0x3F80, 0xBF80]], np.uint16), cbf).tolist() == [0x80, 0x3F, 0x80, 0xBF]
    assert F.pack(np.zeros(0, np.uint8), fp4).size == 0


@pytest.mark.parametrize(
    "fmt, shape, nbytes",
    [
        (F.get("float4_e2m1fn"), (3,), 1),
        (F.get("float4_e2m1fn"), (3,), 3),
        (F.binary(5, 6), (4096,), 6143),
        (F.get("float32"), (2,), 7),
        (F.get("complex64"), (2,), 8),
        (F.complex_of("bfloat16"), (1,), 2),
    ],
)
def test_unpack_wrong_length_raises(fmt, shape, nbytes):
    with pytest.raises(FormatError):
        F.unpack(np.zeros(nbytes, np.uint8), fmt, shape)


def test_pack_rejects_out_of_range_bits():
    with pytest.raises(FormatError):
        F.pack(np.array([16], np.uint8), F.get("float4_e2m1fn"))
    with pytest.raises(FormatError):
        F.pack(np.array([4096], np.uint16), F.binary(5, 6))
    with pytest.raises(FormatError):
        F.pack(np.array([1.0]), F.get("float32"))


# ============================================================================================
# Encoded
# ============================================================================================


def test_encoded_basics():
    bits = np.array([[0x3F80, 0x4000, 0xBF80]], dtype=np.uint16)
    enc = Encoded(bits, "bfloat16")
    assert enc.format == F.get("bfloat16") and enc.bits.dtype == np.uint16
    assert enc.shape == (1, 3) and enc.ndim == 2 and enc.size == 3
    assert enc.decode().tolist() == [[1.0, 2.0, -1.0]]
    assert Encoded.from_values([[1.0, 2.0, -1.0]], "bfloat16") == enc
    assert Encoded(bits.astype(np.int64), F.get("bfloat16")) == enc  # converted to storage
    assert Encoded(bits, "bfloat16") != Encoded(bits, "float16")
    assert "bfloat16" in repr(enc)
    with pytest.raises(TypeError):
        hash(enc)


@pytest.mark.parametrize(
    "bits, fmt",
    [
        (np.array([16], np.uint8), "float4_e2m1fn"),
        (np.array([64], np.uint8), "float6_e2m3fn"),
        (np.array([4096], np.uint16), F.binary(5, 6)),
        (np.array([-1], np.int16), "bfloat16"),
        (np.array([70000], np.int64), "bfloat16"),
        (np.array([1.0]), "float32"),
        (np.array([True]), "bool"),
        (np.array([2], np.uint8), "bool"),
        (np.array([1], np.uint8), "no_such_format"),
        (np.array([1], np.uint8), 8),
        (np.zeros((2, 3), np.uint16), "complex(bfloat16)"),
    ],
)
def test_encoded_rejects_bad_bits(bits, fmt):
    with pytest.raises(FormatError):
        Encoded(bits, fmt)


def test_encoded_slicing_keeps_format():
    fmt = F.binary(5, 6)
    enc = Encoded(np.arange(24, dtype=np.uint16).reshape(4, 6), fmt)
    part = enc[1:3, ::2]
    assert part.format == fmt and part.shape == (2, 3)
    assert part.bits.tolist() == [[6, 8, 10], [12, 14, 16]]
    assert enc[0].shape == (6,) and enc[0, 0].shape == ()


def test_encoded_complex_shape_excludes_pair_axis():
    fmt = F.complex_of("bfloat16")
    bits = np.arange(3 * 4 * 2, dtype=np.uint16).reshape(3, 4, 2)
    enc = Encoded(bits, fmt)
    assert enc.shape == (3, 4) and enc.ndim == 2 and enc.size == 12
    assert enc.decode().shape == (3, 4) and enc.decode().dtype == np.complex128
    for part, shape in (
        (enc[1], (4,)),
        (enc[:, 1:3], (3, 2)),
        (enc[..., 0], (3,)),
        (enc[2, 3], ()),
    ):
        assert part.format == fmt and part.shape == shape and part.bits.shape == shape + (2,)
    assert enc[2, 3].bits.tolist() == [22, 23]


# ============================================================================================
# Layout
# ============================================================================================

BASE_SPECS = [
    ("w", (2, 3), "float32"),
    ("b", (3,), "bfloat16"),
    ("s", (4,), F.binary(5, 6)),
    ("n", (), "int64"),
]


def layout(specs=BASE_SPECS) -> Layout:
    return Layout.from_specs(specs)


def replace(specs, name, shape=None, fmt=None):
    return [
        (n, shape if n == name and shape is not None else s, fmt if n == name and fmt else f)
        for n, s, f in specs
    ]


def test_layout_from_specs():
    lay = layout()
    assert lay.names() == ["w", "b", "s", "n"] and len(lay) == 4
    assert [e.index for e in lay] == [0, 1, 2, 3]
    assert lay["s"] == Entry(2, "s", (4,), F.binary(5, 6))
    assert lay[1].format == F.get("bfloat16") and "w" in lay and "x" not in lay
    assert lay["w"].size == 6 and lay["w"].nbytes == 24 and lay["n"].size == 1
    assert lay["s"].nbytes == 8  # two-byte containers, not packed
    assert Layout.from_specs([("c", (2,), "complex64")])["c"].nbytes == 16
    assert lay.subset(["s", "w"]).names() == ["s", "w"]
    assert lay == layout() and hash(lay) == hash(layout())
    with pytest.raises(KeyError):
        lay["x"]


@pytest.mark.parametrize(
    "specs, error",
    [
        ([("a", (1,), "float32"), ("a", (2,), "float16")], LayoutError),
        ([("a", (-1,), "float32")], LayoutError),
        ([("a", (1,), "nope")], FormatError),
        ([("a", (1,), 32)], FormatError),
    ],
)
def test_layout_rejects_bad_specs(specs, error):
    with pytest.raises(error):
        Layout.from_specs(specs)


def test_layout_rejects_bad_entries():
    with pytest.raises(LayoutError):
        Layout([Entry(1, "a", (1,), F.get("float32"))])
    with pytest.raises(LayoutError):
        Layout([Entry(0, "a", (1.5,), F.get("float32"))])


def kinds(diffs):
    return [(d.kind, d.name) for d in diffs]


def check_error(actual: Layout, expected: Layout, **options) -> LayoutError:
    with pytest.raises(LayoutError) as info:
        actual.check(expected, **options)
    err = info.value
    assert err.differences == actual.diff(expected, **options)
    for d in err.differences:
        assert isinstance(d, Difference)
        assert str(d) in str(err)
        if d.name is not None:
            assert repr(d.name) in str(err)
    return err


def test_layout_equal_has_no_difference():
    assert layout().diff(layout()) == []
    layout().check(layout())


def test_diff_count_and_extra():
    actual = layout(BASE_SPECS + [("x", (1,), "float16")])
    err = check_error(actual, layout())
    assert kinds(err.differences) == [("count", None), ("extra", "x")]
    assert err.differences[0].expected == 4 and err.differences[0].actual == 5
    assert "float16[1]" in str(err)
    assert actual.diff(layout(), allow_extra=True) == []


def test_diff_count_and_missing():
    actual = layout(BASE_SPECS[:3])
    err = check_error(actual, layout())
    assert kinds(err.differences) == [("count", None), ("missing", "n")]
    assert "int64[]" in str(err)
    assert actual.diff(layout(), allow_missing=True) == []


def test_diff_missing_and_extra_without_count():
    actual = layout(BASE_SPECS[:3] + [("m", (), "int64")])
    err = check_error(actual, layout())
    assert kinds(err.differences) == [("missing", "n"), ("extra", "m")]
    assert actual.diff(layout(), allow_missing=True, allow_extra=True) == []


def test_diff_shape():
    err = check_error(layout(replace(BASE_SPECS, "w", shape=(3, 2))), layout())
    assert kinds(err.differences) == [("shape", "w")]
    assert (err.differences[0].expected, err.differences[0].actual) == ([2, 3], [3, 2])


@pytest.mark.parametrize(
    "name, actual_fmt",
    [
        ("w", "float16"),  # other family, other width
        ("s", F.binary(5, 10)),  # same exponent bits, other width: 12 vs 16 bits
        ("s", F.binary(5, 6, bias=14)),  # same width, other bias
        ("s", F.binary(5, 6, encoding="finite")),  # same width, other encoding
        ("b", "float16"),  # same width, other layout
        ("n", "uint64"),
    ],
)
def test_diff_format(name, actual_fmt):
    actual = layout(replace(BASE_SPECS, name, fmt=actual_fmt))
    err = check_error(actual, layout())
    assert kinds(err.differences) == [("format", name)]
    d = err.differences[0]
    assert d.expected.startswith(layout()[name].format.tag)
    assert d.actual.startswith(actual[name].format.tag)
    assert f"({layout()[name].format.width} bits)" in d.expected
    assert f"({actual[name].format.width} bits)" in d.actual


def test_diff_format_same_family_different_width_message():
    actual = layout(replace(BASE_SPECS, "s", fmt=F.binary(5, 10)))
    err = check_error(actual, layout())
    assert "binary_5_6_15_ieee (12 bits)" in str(err) and "float16 (16 bits)" in str(err)


def test_diff_order():
    actual = layout([BASE_SPECS[1], BASE_SPECS[0]] + BASE_SPECS[2:])
    err = check_error(actual, layout())
    assert kinds(err.differences) == [("order", "w"), ("order", "b")]
    assert (err.differences[0].expected, err.differences[0].actual) == (0, 1)
    assert actual.diff(layout(), order_matters=False) == []


def test_many_differences_in_one_error():
    specs = [
        ("s", (4,), F.binary(5, 10)),  # format, and out of order
        ("b", (4,), "bfloat16"),  # shape
        ("x", (1,), "float16"),  # extra
    ]  # "w" and "n" missing
    actual = layout(specs)
    err = check_error(actual, layout())
    found = kinds(err.differences)
    assert set(found) == {
        ("count", None),
        ("missing", "w"),
        ("shape", "b"),
        ("format", "s"),
        ("missing", "n"),
        ("extra", "x"),
        ("order", "b"),
        ("order", "s"),
    }
    assert len(found) == 8
    message = str(err)
    assert "(8 differences)" in message and message.count("\n  - ") == 8
    for name in ("w", "b", "s", "n", "x"):
        assert repr(name) in message
    lenient = actual.diff(layout(), allow_missing=True, allow_extra=True, order_matters=False)
    assert set(kinds(lenient)) == {("shape", "b"), ("format", "s")}


def test_layout_json_round_trip():
    lay = layout(BASE_SPECS + [("c", (2, 2), F.complex_of("bfloat16"))])
    items = json.loads(json.dumps(lay.to_json()))
    assert items[2] == {
        "index": 2,
        "name": "s",
        "shape": [4],
        "format": "binary_5_6_15_ieee",
        "width": 12,
    }
    assert items[4]["format"] == "complex(bfloat16)" and items[4]["width"] == 32
    assert Layout.from_json(items) == lay
    no_width = [{k: v for k, v in item.items() if k != "width"} for item in items]
    assert Layout.from_json(no_width) == lay


GOOD_ITEM = {"name": "a", "shape": [2], "format": "float32"}


@pytest.mark.parametrize(
    "items, error",
    [
        ({"a": 1}, LayoutError),
        ("[]", LayoutError),
        ([1], LayoutError),
        ([{"shape": [2], "format": "float32"}], LayoutError),
        ([{"name": "a", "shape": 2, "format": "float32"}], LayoutError),
        ([{"name": "a", "shape": [2]}], LayoutError),
        ([{"name": "a", "shape": [-1], "format": "float32"}], LayoutError),
        ([{"name": "a", "shape": [True], "format": "float32"}], LayoutError),
        ([{"name": "a", "shape": [1.5], "format": "float32"}], LayoutError),
        ([{"name": 3, "shape": [2], "format": "float32"}], LayoutError),
        ([GOOD_ITEM, GOOD_ITEM], LayoutError),
        ([{"name": "a", "shape": [2], "format": "float33"}], FormatError),
        ([{"name": "a", "shape": [2], "format": "binary_5_6_15_ieee", "width": 16}], FormatError),
    ],
)
def test_layout_from_json_rejects_malformed(items, error):
    with pytest.raises(error):
        Layout.from_json(items)


# ============================================================================================
# docs/FORMAT.md agrees with the registry
# ============================================================================================


def test_format_md_standard_table_matches_registry():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "FORMAT.md").read_text("utf-8")
    section = text[text.index("### 1.8 Standard tags") : text.index("### 1.9")]
    rows = [
        [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| `")
    ]
    assert [row[0] for row in rows] == list(F.STANDARD)
    for tag, e, f, bias, enc, width, container, dtype, torchlean in rows:
        fmt = F.get(tag)
        assert int(width) == fmt.width
        assert container.split()[0] == str(fmt.storage_dtype)
        module, name = dtype.split(".")
        scalar_type = getattr({"numpy": np, "ml_dtypes": ml_dtypes}[module], name)
        assert np.dtype(scalar_type) == fmt.numpy_dtype
        assert torchlean == (fmt.torchlean_tag or "none")
        if isinstance(fmt, F.BinaryFormat):
            assert (int(e), int(f), int(bias), enc) == params(fmt)
