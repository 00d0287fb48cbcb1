"""Decoding the chunks of ``compression="weights"`` Zarr arrays without zarr's codec pipeline.

``compression="weights"`` stores each chunk through the codecs ``bytes`` (little endian),
``blosc`` and ``crc32c`` (inside ``sharding_indexed`` for large tensors, its index ``bytes`` +
``crc32c`` at the end): a stored chunk is one Blosc 1 frame (16-byte header, then the shuffled,
compressed blocks) followed by the CRC-32C of that frame. The direct reader
(:class:`lean_store.stores.zarr.direct_read.DirectReader`) reads such a chunk with one
``pread``, checks the CRC-32C over the frame, checks the frame's header
(:mod:`lean_store.stores.blosc_frames`), and only then lets numcodecs' Blosc (the library zarr
itself calls) decompress it straight into the output: zarr-python's pipeline costs about half
the load speed on top of the decompression (docs/PERFORMANCE.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...integrity import crc32c_extend
from ..blosc_frames import HEADER, decode_frame, frame_size_limit
from .compat import codec_documents, sharding_document

_CNAMES = {"blosclz", "lz4", "lz4hc", "snappy", "zlib", "zstd"}
_SHUFFLES = {"noshuffle", "shuffle", "bitshuffle"}


def _blosc_codecs(codecs: list[dict[str, Any]]) -> bool:
    """``codecs`` are exactly ``bytes`` (little endian or none) + ``blosc`` with a
    configuration Blosc 1 knows + ``crc32c``."""
    if [c.get("name") for c in codecs] != ["bytes", "blosc", "crc32c"]:
        return False
    endian = (codecs[0].get("configuration") or {}).get("endian", "little")
    conf = codecs[1].get("configuration") or {}
    typesize = conf.get("typesize", 1)
    return (
        endian in (None, "little")
        and conf.get("cname") in _CNAMES
        and conf.get("shuffle", "noshuffle") in _SHUFFLES
        and isinstance(typesize, int) and 1 <= typesize <= 255
    )


def blosc_layout(array: Any) -> bool:
    """True when ``array`` (a zarr array or its metadata document) stores its chunks as
    ``compression="weights"`` writes them: Blosc frames with a CRC-32C, unsharded, or inside
    ``sharding_indexed`` with a plain index (``bytes`` + ``crc32c``) at the end."""
    shard = sharding_document(array)
    if shard is None:
        return _blosc_codecs(codec_documents(array))
    index = [c.get("name") for c in shard.get("index_codecs") or []]
    return (
        len(codec_documents(array)) == 1
        and _blosc_codecs(list(shard.get("codecs") or []))
        and index == ["bytes", "crc32c"]
        and shard.get("index_location", "end") == "end"
    )


def stored_size_limit(chunk_nbytes: int) -> int:
    """The most bytes a stored chunk (frame and CRC) of ``chunk_nbytes`` can take."""
    return frame_size_limit(chunk_nbytes) + 4


def stored_size_ok(nbytes: int, chunk_nbytes: int) -> bool:
    """A stored chunk of ``nbytes`` (frame and CRC) can hold a chunk of ``chunk_nbytes``."""
    return HEADER + 4 <= nbytes <= stored_size_limit(chunk_nbytes)


def decode_chunk(stored: np.ndarray, chunk_nbytes: int, dst: np.ndarray) -> str | None:
    """Check and decompress one stored chunk (``stored``: the Blosc frame, then its CRC-32C)
    into ``dst`` (flat uint8: the whole chunk, or a prefix of it at the array's edge). Returns
    what is wrong with it, or None when ``dst`` now holds the chunk's bytes."""
    frame, tail = stored[:-4], stored[-4:]
    crc = crc32c_extend(0, frame)
    if crc != int.from_bytes(tail.tobytes(), "little"):
        return f"fails its crc32c check (computed {crc:#010x})"
    return decode_frame(frame, chunk_nbytes, dst)


__all__ = ["blosc_layout", "decode_chunk", "stored_size_limit", "stored_size_ok"]
