"""A faster encoder for Zarr v3's ``crc32c`` codec, with the same bytes on disk.

zarr 3.1's :class:`zarr.codecs.Crc32cCodec` encodes with ``np.append(data, checksum)``: it
ravels the chunk, allocates, and copies. :class:`LeanCrc32cCodec` allocates the output once,
copies the chunk into it, and computes the CRC-32C (``google_crc32c``, hardware, as zarr
does) over the copy while it is still in cache. The stored form is exactly the zarr v3 spec's
and the stock codec's: the chunk bytes followed by their CRC-32C as a little-endian uint32
(checked by ``tests/test_zarr_crc.py``). Its metadata is ``{"name": "crc32c"}``, so stock zarr
reads what it writes.

lean_store's Zarr writer passes an instance of it to ``create_array``; nothing is registered in
zarr's codec registry or config, so zarr's behaviour elsewhere in the process is unchanged.
Decoding is the stock codec's (a view of the chunk, no copy). Uncompressed arrays are written
by :mod:`lean_store.zarr_direct` instead; this encoder serves compressed ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import google_crc32c
import numpy as np
from zarr.codecs import Crc32cCodec

if TYPE_CHECKING:
    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer


@dataclass(frozen=True)
class LeanCrc32cCodec(Crc32cCodec):
    """zarr's ``crc32c`` codec with a one-allocation, one-copy encoder."""

    def _encode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer | None:
        data = chunk_bytes.as_numpy_array().reshape(-1).view(np.uint8)
        n = data.size
        out = np.empty(n + 4, np.uint8)
        out[:n] = data
        out[n:] = np.array([google_crc32c.value(out[:n])], dtype="<u4").view(np.uint8)
        return chunk_spec.prototype.buffer.from_array_like(out)


__all__ = ["LeanCrc32cCodec"]
