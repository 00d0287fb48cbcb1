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

import math
from functools import lru_cache
from typing import Any

import google_crc32c
import numpy as np

from .errors import IntegrityError

CHUNK_CRC_ATTR = "chunk_crc32c"
CHECKSUMS = ("crc32c", "fletcher32+crc32c")  # HDF5 per-chunk checksum choices; first = default


def crc32c_of(bits: Any, crc: int = 0) -> int:
    """CRC-32C of an array's raw bytes in C order, continuing from ``crc``; no copy when the
    array is already C-contiguous."""
    arr = np.asarray(bits)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    if arr.size == 0:
        return crc
    return google_crc32c.extend(crc, arr.reshape(-1).view(np.uint8))


def _gf2_apply(matrix: tuple[int, ...], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _gf2_square(matrix: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_gf2_apply(matrix, column) for column in matrix)


@lru_cache(maxsize=1)
def _one_byte() -> tuple[int, ...]:
    """The linear operator 'feed one zero byte' on a CRC value, as 32 columns."""
    base = google_crc32c.extend(0, b"\0")
    return tuple(google_crc32c.extend(1 << j, b"\0") ^ base for j in range(32))


@lru_cache(maxsize=256)
def _shift_operator(nbytes: int) -> tuple[int, ...]:
    """The operator 'feed ``nbytes`` zero bytes' (so that crc(A+B) = op(crc(A)) ^ crc(B))."""
    result: tuple[int, ...] | None = None
    power = _one_byte()
    n = nbytes
    while n:
        if n & 1:
            result = power if result is None else tuple(_gf2_apply(power, c) for c in result)
        n >>= 1
        if n:
            power = _gf2_square(power)
    return result if result is not None else tuple(1 << j for j in range(32))


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32C of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` in bytes."""
    if crc_a == 0 or len_b == 0:
        return crc_b if len_b else crc_a
    return _gf2_apply(_shift_operator(len_b), crc_a) ^ crc_b


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
    """Chunks of the form lean_store writes: ``(1, ..., 1, c, d(k+1), ..., dn)``."""
    if len(chunks) != len(shape):
        return False
    split = next((i for i, (c, d) in enumerate(zip(chunks, shape)) if c < d), None)
    if split is None:
        return True  # one chunk holds it all
    return all(c == 1 for c in chunks[:split]) and all(
        c >= d for c, d in zip(chunks[split + 1 :], shape[split + 1 :])
    )


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
    grid = table_size(shape, chunks)
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


def grid_shape(shape: tuple[int, ...], chunks: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-d // c) for d, c in zip(shape, chunks))


def chunk_number(coords: tuple[int, ...], grid: tuple[int, ...]) -> int:
    """Position of chunk ``coords`` in C order of the chunk grid."""
    n = 0
    for c, g in zip(coords, grid):
        n = n * g + c
    return n


def table_size(shape: tuple[int, ...], chunks: tuple[int, ...]) -> int:
    return math.prod(grid_shape(shape, chunks))


__all__ = [
    "CHECKSUMS", "CHUNK_CRC_ATTR", "chunk_number", "crc32c_combine", "crc32c_of", "grid_shape",
    "is_row_block", "parse_table", "rechunked_message", "table_size",
]
