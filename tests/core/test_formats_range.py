"""Formats whose values do not all embed in binary64 are never silently rounded."""

from __future__ import annotations

import numpy as np
import pytest

import lean_store as ls
from lean_store import formats

WIDE = [formats.binary(15, 48), formats.binary(2, 61), formats.binary(11, 52, bias=1000)]


@pytest.mark.parametrize("fmt", WIDE, ids=lambda f: f.tag)
def test_wide_formats_refuse_inexact_codecs(fmt):
    assert not fmt.embeds_in_float64
    with pytest.raises(ls.FormatError, match="not binary64 values"):
        fmt.encode([1.0])
    bits = np.array([0, 1, 1 << (fmt.width - 2)], dtype=np.uint64)
    with pytest.raises(ls.FormatError, match="exact=False"):
        fmt.decode(bits)
    approx = fmt.decode(bits, exact=False)
    assert approx.dtype == np.float64 and approx[0] == 0.0
    with pytest.raises(ls.FormatError):
        formats.complex_of(fmt).encode([1 + 1j])


def test_wide_formats_still_store_exact_bits(tmp_path):
    fmt = formats.binary(2, 61)
    bits = np.array([0, 1, (1 << 64) - 1, 12345678901234567], dtype=np.uint64)
    for suffix in (".h5", ".zarr"):
        path = tmp_path / f"wide{suffix}"
        ls.save({"w": ls.Encoded(bits, fmt)}, path)
        back = ls.load_state(path)["w"]
        assert back.format == fmt and np.array_equal(back.bits, bits)
        with pytest.raises(ls.FormatError):
            back.decode()


def test_embedding_boundaries():
    assert formats.get("float64").embeds_in_float64
    assert formats.binary(11, 52, bias=1023).embeds_in_float64
    assert not formats.binary(11, 53 - 1, bias=1022).embeds_in_float64  # max exponent 1024
    assert formats.binary(8, 23, encoding="finite").embeds_in_float64


@pytest.mark.parametrize(
    "tag",
    [
        "binary_05_6_15_ieee",
        "binary_5_06_15_ieee",
        "binary_5_6_-0_ieee",
        "binary_5_6_015_ieee",
        "binary_٥_6_15_ieee",
        "binary_+5_6_15_ieee",
    ],
)
def test_non_canonical_tags_are_refused(tag):
    with pytest.raises(ls.FormatError, match="unknown format tag"):
        formats.get(tag)


def test_every_tag_round_trips_to_itself():
    for tag in ["binary_5_6_15_ieee", "binary_5_6_0_ieee", "complex(binary_3_2_4_finite)"]:
        assert formats.get(tag).tag == tag


def test_standard_formats_spelled_as_binary_tags_canonicalize():
    assert formats.get("binary_3_2_3_finite").tag == "float6_e3m2fn"
    assert formats.get("complex(binary_8_23_127_ieee)").tag == "complex64"
