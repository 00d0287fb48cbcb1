"""The index at the end of a Zarr v3 shard file, as lean_store writes and reads it.

``sharding_indexed`` with ``index_location="end"`` and index codecs ``bytes`` (little endian)
+ ``crc32c``: one ``(offset, nbytes)`` pair of little-endian uint64 per inner chunk, in C order
of the chunks in the shard (both ``2**64-1`` for a chunk that is absent), followed by the
CRC-32C of those bytes (docs/FORMAT.md). The one place this layout is spelled out.
"""

from __future__ import annotations

import google_crc32c
import numpy as np

EMPTY = (1 << 64) - 1
"""Offset and size of a slot whose chunk is absent (read as the fill value)."""
CRC_BYTES = 4


def index_bytes(n_slots: int, *, crc: bool = True) -> int:
    """Bytes of the index of a shard of ``n_slots`` inner chunks (its CRC-32C included)."""
    return 16 * n_slots + (CRC_BYTES if crc else 0)


def encode(entries: np.ndarray) -> list[bytes]:
    """The index bytes of ``entries`` (``(n_slots, 2)`` offsets and sizes), then their CRC."""
    raw = np.ascontiguousarray(entries, dtype="<u8").tobytes()
    return [raw, google_crc32c.value(raw).to_bytes(CRC_BYTES, "little")]


def empty(n_slots: int) -> np.ndarray:
    """An index with every slot absent, to be filled in as chunks are laid out."""
    return np.full((n_slots, 2), EMPTY, dtype="<u8")


def decode(raw: bytes, n_slots: int) -> np.ndarray | None:
    """The ``(n_slots, 2)`` table of an index read from a shard's end; None when its length
    or its CRC-32C is wrong."""
    if len(raw) != index_bytes(n_slots):
        return None
    body = raw[:-CRC_BYTES]
    if google_crc32c.value(body) != int.from_bytes(raw[-CRC_BYTES:], "little"):
        return None
    return np.frombuffer(body, "<u8").reshape(n_slots, 2)


def is_empty(offset: int, nbytes: int) -> bool:
    return offset == EMPTY and nbytes == EMPTY
