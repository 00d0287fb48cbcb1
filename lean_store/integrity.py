"""CRC-32C (Castagnoli): of a buffer, combined across buffers, and updated block by block.

The one checksum lean_store computes: per chunk on the way in, checked per chunk on the way out,
and folded into each tensor's whole-tensor digest with :func:`crc32c_combine`.

Two libraries compute it, with the same results: ``google_crc32c`` (zarr's) holds the GIL for
the whole call, so a CRC pass on one thread stopped every other thread's Python (the CRC
workers of a save, the second thread of a load) for its duration, ~75 us per MiB here;
``crc32c`` releases the GIL for the call, so buffers of :data:`RELEASE_BYTES` or more go to it
(:func:`crc32c_extend`). Short buffers stay with ``google_crc32c``, whose call costs the same.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

import google_crc32c
import numpy as np

from .shared_threads import SharedThreads


def _gil_releasing() -> Callable[[Any, int], int] | None:
    """``crc32c.crc32c`` (which releases the GIL from crc32c 2.5), or None without it."""
    try:
        import crc32c
    except ImportError:  # pragma: no cover - a dependency; google_crc32c computes the same
        return None
    return crc32c.crc32c


_RELEASED = _gil_releasing()

RELEASE_BYTES = 64 << 10
"""Buffers this long or longer are checksummed with the GIL released (~5 us of CRC here)."""


def crc32c_extend(crc: int, data: Any) -> int:
    """CRC-32C of ``data``'s bytes (bytes, or a flat C-contiguous uint8 array) continuing
    from ``crc``, as ``google_crc32c.extend`` computes it; long buffers with the GIL
    released, so that other threads run meanwhile."""
    size = data.nbytes if hasattr(data, "nbytes") else len(data)  # an array: its bytes
    if _RELEASED is not None and size >= RELEASE_BYTES:
        return int(_RELEASED(data, crc))
    return int(google_crc32c.extend(crc, data))


def crc32c_of(bits: Any, crc: int = 0) -> int:
    """CRC-32C of an array's raw bytes in C order, continuing from ``crc``; no copy when the
    array is already C-contiguous."""
    arr = np.asarray(bits)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    if arr.size == 0:
        return crc
    return crc32c_extend(crc, arr.reshape(-1).view(np.uint8))


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


def crc32c_update(crc: int, bits: np.ndarray) -> int:
    return crc32c_of(bits, crc)


_CRC_WORKERS = SharedThreads(2, "lean_store-crc")


def crc_workers() -> ThreadPoolExecutor:
    """The two threads every save and load of the process shares for CRC-32C passes and the
    reads and writes that go with them (started once per process, not once per save)."""
    return _CRC_WORKERS.get()


def forget_crc_workers() -> None:
    """In a forked child the parent's worker threads do not exist: start afresh."""
    _CRC_WORKERS.forget()
