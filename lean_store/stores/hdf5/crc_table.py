"""Per-chunk CRC-32C: the table HDF5 datasets carry in the ``chunk_crc32c`` attribute.

One uint32 per chunk, in C order of the chunk grid: the CRC-32C (Castagnoli, initial value 0, as
``google_crc32c.value`` computes it) of the chunk's raw little-endian words over the chunk region
clipped to the dataset, in C order within the region (the words a writer holds in memory; for
row-block chunks, a contiguous run of the tensor's bytes). It is hardware CRC (several GB/s),
where HDF5's fletcher32 filter runs byte by byte.

Because CRC-32C is linear, the whole-tensor digest is derived from the per-chunk values with
:func:`crc32c_combine` (no second pass over the data).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...chunking import chunk_count, last_cut_axis
from ...errors import IntegrityError

CHUNK_CRC_ATTR = "chunk_crc32c"
CHECKSUMS = ("crc32c", "fletcher32+crc32c")  # HDF5 per-chunk checksum choices; first = default


def parse_table(
    value: Any, n_chunks: int, where: str, *, shape: tuple[int, ...] | None = None,
    chunks: tuple[int, ...] | None = None,
) -> np.ndarray:
    """The ``chunk_crc32c`` attribute as a uint32 array of ``n_chunks`` values, or a typed
    error for anything else (wrong type, rank or length). With the dataset's ``shape`` and
    ``chunks``, a table that cannot belong to that chunking (wrong length, or chunks that are
    not the row blocks lean_store writes) is reported as a re-chunked dataset."""
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "iu":
        raise IntegrityError(f"{where}: {CHUNK_CRC_ATTR} is not an integer array ({value!r:.80})")
    if value.ndim != 1:
        raise IntegrityError(f"{where}: {CHUNK_CRC_ATTR} is not a flat list ({value.ndim}-d)")
    if shape is not None and chunks is not None and (
        value.size != n_chunks or not is_row_block(shape, chunks)
    ):
        raise IntegrityError(rechunked_message(where, shape, chunks, value.size))
    if value.size != n_chunks:
        raise IntegrityError(
            f"{where}: {CHUNK_CRC_ATTR} holds {value.size} values for {n_chunks} chunks"
        )
    if value.dtype != np.uint32:
        if value.size and (int(value.min()) < 0 or int(value.max()) >= 1 << 32):
            raise IntegrityError(f"{where}: {CHUNK_CRC_ATTR} holds values outside uint32")
        value = value.astype(np.uint32)
    return value


def is_row_block(shape: tuple[int, ...], chunks: tuple[int, ...]) -> bool:
    """Chunks of the form lean_store writes: ``(1, ..., 1, c, d(k+1), ..., dn)``. The split
    axis is the last one the chunks cut: in ``(1, 256)`` chunks of a ``(600, 1000)`` dataset
    (what :func:`lean_store.chunking.plan_chunks` gives when one row exceeds the chunk
    budget) it is the second; the leading 1 cuts the first axis too."""
    if len(chunks) != len(shape):
        return False
    split = last_cut_axis(shape, chunks)
    return split is None or all(c == 1 for c in chunks[:split])


def table_chunks(shape: tuple[int, ...], n_table: int) -> list[tuple[int, ...]]:
    """The row-block chunk shapes whose grid has ``n_table`` chunks (what a table of that
    length was written for), at most a few; [] when none fits."""
    found: list[tuple[int, ...]] = []
    outer = 1
    for k, d in enumerate(shape):
        if n_table % outer == 0 and d > 0:
            along = n_table // outer
            rows = [c for c in range(-(-d // max(1, along)), d + 1) if -(-d // c) == along]
            found.extend((1,) * k + (c,) + tuple(shape[k + 1 :]) for c in rows[:3])
        outer *= max(1, d)
        if outer > n_table:
            break
    return found[:3]


def rechunked_message(
    where: str, shape: tuple[int, ...], chunks: tuple[int, ...], n_table: int
) -> str:
    """Why a dataset whose chunking no longer matches its ``chunk_crc32c`` table is refused,
    and what to do about it."""
    grid = chunk_count(shape, chunks)
    wanted = table_chunks(shape, n_table)
    node = where.strip("'\"")
    if len(wanted) == 1:
        back = (
            f"re-chunk it back (h5repack -l {node}:CHUNK={'x'.join(map(str, wanted[0]))}), or "
        )
        table = f"chunks of {wanted[0]}"
    else:
        back = ""
        table = "lean_store's row-block chunks" + (f" (e.g. {wanted[0]})" if wanted else "")
    return (
        f"{where}: its {CHUNK_CRC_ATTR} table holds {n_table} values for {grid} chunks of "
        f"{chunks}; it was written for {table}: the dataset was re-chunked after lean_store "
        "wrote it (e.g. by h5repack -l CHUNK=...). The data may be intact, but the per-chunk "
        f"checksums no longer apply, so it is not read. To use it, {back}restore the original "
        "file, or re-save the tensors with lean_store from a copy you trust"
    )


def unchunked_message(where: str, shape: tuple[int, ...], n_table: int | None) -> str:
    """Why a dataset stored without chunks (contiguous or compact: laid out again after
    lean_store wrote it) is refused, and the command that lays it out as written, when its
    ``chunk_crc32c`` table of ``n_table`` values names one chunk shape."""
    wanted = table_chunks(shape, n_table) if n_table else []
    node = where.strip("'\"")
    back = (f"re-chunk it back (h5repack -l {node}:CHUNK={'x'.join(map(str, wanted[0]))}), or "
            if len(wanted) == 1 else "")
    return (
        f"{where} is not chunked (laid out again after lean_store wrote it, e.g. by h5repack "
        "-l CONTI); lean_store writes chunked datasets only and checks each chunk against "
        f"its {CHUNK_CRC_ATTR} table, so it is not read. The data may be intact. To use it, "
        f"{back}restore the original file, or re-save the tensors with lean_store from a copy "
        "you trust"
    )


__all__ = [
    "CHECKSUMS", "CHUNK_CRC_ATTR", "is_row_block", "parse_table", "rechunked_message",
    "table_chunks", "unchunked_message",
]
