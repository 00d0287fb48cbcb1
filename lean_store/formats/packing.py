"""Dense bit packing for widths that are not a whole number of bytes (fp4, fp6, 12-bit, ...).

Words are packed little-endian: word ``i`` occupies bits ``[i*w, (i+1)*w)`` of the stream, and
bit ``b`` of the stream is bit ``b % 8`` of byte ``b // 8``. The last byte is zero-padded.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import FormatError
from .codecs import check_bits
from .model import ScalarFormat


def packed_nbytes(count: int, fmt: ScalarFormat) -> int:
    """Bytes needed for ``count`` values of ``fmt``."""
    return math.ceil(count * fmt.words_per_value * fmt.word_width / 8)


def pack(bits: np.ndarray, fmt: ScalarFormat) -> np.ndarray:
    """Pack raw words (any shape, C order) into a 1-D uint8 stream of ``word_width`` bits each."""
    words = check_bits(fmt, bits).reshape(-1)
    width = fmt.word_width
    if width % 8 == 0:
        return words.astype(words.dtype.newbyteorder("<"), copy=False).view(np.uint8).copy()
    if width == 4:  # two words a byte (fp4, int4): the same stream without the bit expansion
        pairs = np.zeros(2 * math.ceil(words.size / 2), dtype=np.uint8)
        pairs[: words.size] = words
        return pairs[0::2] | (pairs[1::2] << 4)
    as_bytes = words.astype("<u8").view(np.uint8).reshape(-1, 8)
    stream = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :width]
    return np.packbits(stream.reshape(-1), bitorder="little")


def unpack(packed: np.ndarray, fmt: ScalarFormat, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of :func:`pack`: the words of ``shape`` (plus ``(2,)`` for complex formats)."""
    packed = np.asarray(packed, dtype=np.uint8).reshape(-1)
    full_shape = tuple(shape) + ((2,) if fmt.words_per_value == 2 else ())
    count = math.prod(full_shape)
    width = fmt.word_width
    if packed.size != packed_nbytes(math.prod(shape), fmt):
        raise FormatError(
            f"packed {fmt.tag} payload of shape {tuple(shape)} needs "
            f"{packed_nbytes(math.prod(shape), fmt)} bytes, got {packed.size}"
        )
    dtype = fmt.storage_dtype
    if width % 8 == 0:
        return packed.view(dtype.newbyteorder("<")).astype(dtype).reshape(full_shape)
    if width == 4:  # two words a byte, the first in bits 0-3
        nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(-1)[:count]
        return nibbles.astype(dtype).reshape(full_shape)
    stream = np.unpackbits(packed, bitorder="little")[: count * width].reshape(count, width)
    padded = np.zeros((count, 64), dtype=np.uint8)
    padded[:, :width] = stream
    words = np.packbits(padded, axis=1, bitorder="little").view("<u8").reshape(-1)
    return words.astype(dtype).reshape(full_shape)
