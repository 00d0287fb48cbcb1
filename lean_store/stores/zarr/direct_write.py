"""Writing whole Zarr v3 chunk and shard files directly, byte for byte what zarr writes.

zarr 3.1's write path copies every chunk several times (the chunk merge, the crc32c codec's
``np.append``, the sharding codec's concatenation) into freshly allocated buffers. For the
arrays lean_store creates without compression (codecs ``bytes`` (little endian) + ``crc32c``,
optionally inside ``sharding_indexed`` with the index at the end, ``write_empty_chunks`` on,
row-block chunks), the file of a whole shard or chunk is simple enough to write from the
caller's buffer with no copy:

- a chunk is its raw little-endian bytes, padded with the fill value (0) to the full chunk
  shape at the array's edge, followed by its CRC-32C as a little-endian uint32;
- a shard is its chunks that intersect the array, in order (row-block shards have one chunk
  axis, where zarr's Morton order is plain order), followed by the index: one
  ``(offset, nbytes)`` pair of little-endian uint64 per chunk (``2**64-1`` twice for a chunk
  outside the array), then the index's own CRC-32C.

``tests/stores/test_zarr_crc.py`` checks the files are identical to zarr's for aligned, edge and
sharded arrays, and that stock ``zarr.open_group`` reads them.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np

from ...chunking import Region
from . import shard_index
from .compat import chunk_key, codec_documents, plain_codecs, sharding_document


def _crc_bytes(data: Any) -> bytes:
    return int(google_crc32c.value(data)).to_bytes(4, "little")


class DirectWriter:
    """Writes whole shards (or whole unsharded chunks) of one zarr array as files; ``array`` is
    the zarr array or its metadata document (``zarr_compat.plain_array_document``)."""

    def __init__(
        self, root: Path, array: Any, chunks: tuple[int, ...], shards: tuple[int, ...] | None,
        itemsize: int, linker: Any = None,
    ) -> None:
        self._root = root
        self._array = array
        self._linker = linker  # incremental steps: a lean_store.stores.zarr.incremental.UnitLinker
        self._chunks = chunks
        self._shards = shards
        self._chunk_nbytes = math.prod(chunks) * itemsize
        self._made: set[Path] = set()

    def write(self, region: Region, data: np.ndarray) -> None:
        """Write the file of the shard (or chunk) whose clipped region is ``region``;
        ``data`` holds its C-contiguous little-endian bytes."""
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        unit = self._shards or self._chunks
        key = chunk_key(self._array, tuple(s.start // u for s, u in zip(region, unit)))
        path = self._root / key
        if path.parent not in self._made:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._made.add(path.parent)
        pieces: list[Any] = []
        if self._shards is None:
            pieces += self._chunk_pieces(flat)
        else:
            size = self._chunk_nbytes
            per_shard = math.prod(s // c for s, c in zip(self._shards, self._chunks))
            index = shard_index.empty(per_shard)
            offset = 0
            for j in range(per_shard):
                part = flat[j * size: (j + 1) * size]
                if part.size == 0:
                    break
                chunk = self._chunk_pieces(part)
                nbytes = sum(len(memoryview(p)) for p in chunk)
                index[j] = (offset, nbytes)
                offset += nbytes
                pieces += chunk
            pieces += shard_index.encode(index)
        if self._linker is not None:
            self._linker.link_or_write(path, key, pieces)
            return
        with open(path, "wb") as f:
            for piece in pieces:
                f.write(piece)

    def _chunk_pieces(self, flat: np.ndarray) -> list[Any]:
        if flat.size < self._chunk_nbytes:  # an edge chunk: zarr pads it with the fill value 0
            full = np.zeros(self._chunk_nbytes, np.uint8)
            full[: flat.size] = flat
            flat = full
        return [flat, _crc_bytes(flat)]


def direct_ok(array: Any) -> bool:
    """True when ``array``'s codecs are exactly the layout :class:`DirectWriter` writes."""
    if sys.byteorder != "little":
        return False
    shard = sharding_document(array)
    if shard is None:
        return plain_codecs(codec_documents(array))
    return (
        len(codec_documents(array)) == 1
        and plain_codecs(shard.get("codecs") or [])
        and plain_codecs(shard.get("index_codecs") or [])
        and shard.get("index_location", "end") == "end"
    )


__all__ = ["DirectWriter", "direct_ok"]
