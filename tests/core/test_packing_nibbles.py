"""4-bit words (fp4, and any configured 4-bit format) are packed two a byte by a direct path;
its stream equals the general bit stream of FORMAT.md (word i in bits [4i, 4i+4), bit b of
the stream bit b % 8 of byte b // 8, the last byte zero-padded), computed here bit by bit."""

from __future__ import annotations

import numpy as np
import pytest

import lean_store as ls
from lean_store.formats import pack, unpack


def _stream(words: np.ndarray, width: int) -> np.ndarray:
    bits = [(int(w) >> k) & 1 for w in words.reshape(-1) for k in range(width)]
    bits += [0] * (-len(bits) % 8)
    return np.array([sum(b << k for k, b in enumerate(bits[i:i + 8]))
                     for i in range(0, len(bits), 8)], dtype=np.uint8)


@pytest.mark.parametrize("fmt", [ls.formats.get("float4_e2m1fn"), ls.formats.binary(2, 1)])
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (3, 4), (2, 3, 5)])
def test_nibble_packing_is_the_general_bit_stream(fmt, shape) -> None:
    words = np.random.default_rng(sum(shape)).integers(0, 16, shape, dtype=np.uint8)
    packed = pack(words, fmt)
    assert packed.tobytes() == _stream(words, 4).tobytes()
    assert np.array_equal(unpack(packed, fmt, shape), words)
