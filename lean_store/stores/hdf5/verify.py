"""What ``verify`` checks in an HDF5 dataset beyond its data: a per-chunk checksum configured,
every chunk inside the file, and no filter skipped for a chunk that may not be."""

from __future__ import annotations

from typing import Any

import h5py
from h5py import h5z

from ..base import ChunkProblem, StoredTensor
from .libhdf5 import chunk_lock

_FILTER_NAMES = {1: "deflate", 2: "shuffle", 3: "fletcher32", 4: "szip", 5: "nbit",
                 6: "scaleoffset", 32000: "lzf", 32001: "blosc"}


def structure_problems(ds: h5py.Dataset, info: StoredTensor) -> list[ChunkProblem]:
    """Structural defects of the chunked dataset ``ds`` described by ``info``."""
    problems: list[ChunkProblem] = []
    if "crc32c" not in info.filters and "fletcher32" not in info.filters:
        problems.append((None, "no per-chunk checksum (no chunk_crc32c table, no fletcher32)"))
    chunks = info.chunk_shape
    try:
        skippable = _skippable_filters(ds.id.get_create_plist())
        file_size = ds.file.id.get_filesize()
        for i in range(ds.id.get_num_chunks()):
            with chunk_lock():
                chunk = ds.id.get_chunk_info(i)
            coords = tuple(o // c for o, c in zip(chunk.chunk_offset, chunks))
            bad = _bad_skips(chunk.filter_mask, skippable)
            if bad:
                problems.append((coords, f"filters skipped for this chunk that may not be "
                                         f"({', '.join(bad)}; mask {chunk.filter_mask})"))
            if chunk.byte_offset is None or chunk.byte_offset + chunk.size > file_size:
                problems.append((coords, "chunk lies outside the file"))
    except (OSError, RuntimeError, ValueError) as exc:
        problems.append((None, f"unreadable chunk index ({exc})"))
    return problems


def _skippable_filters(dcpl: Any) -> list[tuple[str, bool]]:
    """(name, may be skipped) for each filter of the pipeline, in order.

    HDF5 skips an *optional* filter (``H5Z_FLAG_OPTIONAL``) for a chunk it fails to encode,
    e.g. LZF on a chunk it cannot shrink, and records that in the chunk's filter
    mask; reading then returns the chunk as stored. That is normal, not damage. A mandatory
    filter is never skipped by HDF5, and a checksum (fletcher32) is never worth skipping, so
    a skipped one of those means the chunk was written by something else."""
    out = []
    for i in range(dcpl.get_nfilters()):
        code, flags = dcpl.get_filter(i)[:2]
        name = _FILTER_NAMES.get(code, f"filter {code}")
        optional = bool(flags & h5z.FLAG_OPTIONAL) and code != h5z.FILTER_FLETCHER32
        out.append((name, optional))
    return out


def _bad_skips(mask: int, pipeline: list[tuple[str, bool]]) -> list[str]:
    """Names of the filters ``mask`` skips although they may not be skipped (bits past the end
    of the pipeline name filters that do not exist)."""
    bad = []
    for bit in range(32):
        if mask >> bit & 1:
            if bit >= len(pipeline):
                bad.append(f"filter #{bit}, which the dataset does not have")
            elif not pipeline[bit][1]:
                bad.append(pipeline[bit][0])
    return bad
