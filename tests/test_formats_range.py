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
