"""HDF5's shuffle + deflate filters, applied by lean_store on two cores instead of one.

HDF5 runs its filter pipeline in the calling thread, one chunk at a time, under h5py's lock;
deflate (~50 MB/s per core here) is then the whole cost of a compressed save. For datasets whose
filters are exactly shuffle, deflate and optionally Fletcher-32 (``compression="weights"`` or
``"gzip"`` without N-bit packing), :class:`DeflateChunks` produces each chunk's stored bytes
itself, in the format HDF5's filters read: the bytes of the full chunk grouped by the datatype
size (HDF5's shuffle: byte ``j`` of element ``i`` goes to ``j * n + i``), a zlib stream of
them (what HDF5's deflate filter inflates; each byte plane deflated, or stored when it does not
compress, see :func:`deflate_planes`), then Fletcher-32 as HDF5 appends it. The deflate runs in a
small thread pool (zlib releases the GIL); chunks go into the file in order, with
``H5Dwrite_chunk`` and filter mask 0 (every filter applied), from the writing thread. HDF5 and
every HDF5 tool read them through their own pipeline; ``tests/core/test_compression_weights.py``
checks the bytes against HDF5's own filters.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from numcodecs.fletcher32 import Fletcher32

from ..ordered_pool import OrderedPool

_FLETCHER32 = Fletcher32()


def shuffle(data: np.ndarray, itemsize: int) -> np.ndarray:
    """HDF5's shuffle filter on a whole chunk's bytes (a multiple of ``itemsize``)."""
    if itemsize <= 1:
        return data
    return np.ascontiguousarray(data.reshape(-1, itemsize).T).reshape(-1)


_SAMPLE = 1 << 16  # bytes of a byte plane deflated to decide whether the plane compresses
_STORE_ABOVE = 0.95  # a sample deflating to more than this fraction is stored, not deflated
_ZLIB_HEADER = b"\x78\x01"  # deflate, 32 KiB window, no preset dictionary, check bits valid


def deflate_planes(shuffled: np.ndarray, itemsize: int, level: int) -> bytes:
    """One zlib stream (what HDF5's deflate filter reads: header, deflate blocks, Adler-32)
    of a shuffled chunk, each byte plane deflated at ``level`` or, when a sample of it does
    not compress (the low mantissa bytes of trained weights are close to random), emitted as
    stored blocks at copy speed: ZipNN's split of exponents from mantissas, in plain deflate.
    Planes are separate raw deflate streams joined at sync-flush points, the last one final."""
    planes = shuffled.reshape(max(1, itemsize), -1)
    out = [_ZLIB_HEADER]
    for j, plane in enumerate(planes):
        sample = plane[:_SAMPLE]
        plane_level = level if len(zlib.compress(sample, level)) < _STORE_ABOVE * max(  # type: ignore[arg-type]
            1, sample.size) else 0
        stream = zlib.compressobj(plane_level, zlib.DEFLATED, -15)
        out.append(stream.compress(plane))  # type: ignore[arg-type]  # numpy stubs: __buffer__ 3.12+
        out.append(stream.flush(zlib.Z_FINISH if j == len(planes) - 1 else zlib.Z_SYNC_FLUSH))
    out.append(zlib.adler32(shuffled).to_bytes(4, "big"))  # type: ignore[arg-type]  # numpy stubs: __buffer__ 3.12+
    return b"".join(out)


def _encode(shuffled: np.ndarray, itemsize: int, level: int, fletcher32: bool
            ) -> bytes | np.ndarray:
    packed = deflate_planes(shuffled, itemsize, level)
    return _FLETCHER32.encode(packed) if fletcher32 else packed


INLINE_BYTES = 64 << 10
"""Chunks smaller than this are compressed on the calling thread when nothing is queued: a
pool hand-off costs more than deflating them (many small tensors: biases, norms)."""


class DeflateChunks:
    """Compress chunks on the writer's ``queue`` (shared by every dataset of a save), hand
    them to ``put(offset, payload)`` in order."""

    def __init__(self, queue: OrderedPool, itemsize: int, level: int,
                 fletcher32: bool, put: Callable[[tuple[int, ...], Any], None]) -> None:
        self._itemsize = itemsize
        self._level = level
        self._fletcher32 = fletcher32
        self._put = put
        self._queue = queue

    def submit(self, offset: tuple[int, ...], chunk: np.ndarray, *, copy: bool = True
               ) -> None:
        """Queue one full chunk (its bytes, padded to the chunk shape). The shuffle copies it
        here, so the caller may reuse ``chunk``'s memory as soon as this returns (with
        ``copy=False`` an unshuffled chunk is read by the workers as it is: it must stay
        unchanged until the queue is flushed)."""
        shuffled = shuffle(chunk, self._itemsize)
        if not self._queue.busy() and chunk.nbytes < INLINE_BYTES:  # not worth a hand-off
            self._put(offset, _encode(shuffled, self._itemsize, self._level, self._fletcher32))
            return
        if shuffled is chunk and copy:
            shuffled = chunk.copy()
        self._queue.submit(functools.partial(self._put, offset), _encode, shuffled,
                           self._itemsize, self._level, self._fletcher32)


__all__ = ["DeflateChunks", "deflate_planes", "shuffle"]
