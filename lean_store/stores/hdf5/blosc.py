"""HDF5's registered Blosc filter (id 32001), applied and undone by lean_store itself.

``compression="weights"`` on HDF5: each chunk is byte-shuffled by the stored word width and
compressed with zstd level 1 in 1 MiB blocks (the same Blosc settings as the Zarr backend's
``"weights"``), on a small thread pool (numcodecs' Blosc releases the GIL), and written with
``H5Dwrite_chunk`` and filter mask 0. The dataset declares the filter as h5py declares a
plugin filter: id 32001 (registered to Blosc with The HDF Group, the filter ``hdf5plugin``
and ``hdf5-blosc`` provide), flag optional, and the seven parameters that filter stores
itself: filter revision 2, Blosc format 2, the type size, the chunk's size in bytes, the
level (1), the shuffle (1: byte) and the compressor (5: zstd). A stored chunk is one Blosc 1
frame (16-byte header, then the blocks), exactly what ``numcodecs.blosc.compress`` returns,
with HDF5's Fletcher-32 after it when that checksum is on.

HDF5 cannot apply a filter it has not loaded, so lean_store writes the chunks itself, and
reads them itself (:func:`read_blosc_chunk`: one ``pread`` at the chunk's file offset, or
``H5Dread_chunk``, then numcodecs): neither needs ``hdf5plugin``. h5py with
``import hdf5plugin``, and h5dump or any HDF5 tool given ``HDF5_PLUGIN_PATH`` to hdf5plugin's
``plugins`` folder, read the same files through the filter
(``tests/core/test_compression_fast.py``); ``compression="weights-gzip"`` keeps to filters
built into every HDF5 library.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from h5py import h5d, h5p, h5z
from numcodecs import blosc
from numcodecs.fletcher32 import Fletcher32

from ...errors import IntegrityError, UnsafeFileError
from ...naming import tensor_ref
from ..blosc_frames import FORMAT, compress, decode_frame, frame_size_limit
from ..ordered_pool import OrderedPool
from .libhdf5 import chunk_lock

BLOSC_FILTER = 32001
"""HDF5 filter id of Blosc (hdf5-blosc, hdf5plugin.Blosc)."""
FILTER_REVISION = 2  # hdf5-blosc's FILTER_BLOSC_VERSION: the parameters below
WEIGHTS_LEVEL = 1
WEIGHTS_SHUFFLE = blosc.SHUFFLE  # 1: byte shuffle by the type size
WEIGHTS_COMPRESSOR = 5  # hdf5-blosc's code for zstd
WEIGHTS_BLOCK_BYTES = 1 << 20  # as the Zarr backend's "weights": zstd sees 1 MiB at a time
INLINE_BYTES = 64 << 10  # smaller chunks are compressed on the calling thread when idle
_FLETCHER32 = Fletcher32()


def blosc_parameters(itemsize: int, chunk_nbytes: int) -> tuple[int, ...]:
    """The filter's parameters for a dataset of ``itemsize``-byte values, as hdf5-blosc
    completes them when it creates a dataset itself (``hdf5plugin.Blosc(cname="zstd",
    clevel=1, shuffle=SHUFFLE)``)."""
    return (FILTER_REVISION, FORMAT, itemsize, chunk_nbytes, WEIGHTS_LEVEL,
            WEIGHTS_SHUFFLE, WEIGHTS_COMPRESSOR)


def can_blosc(itemsize: int) -> bool:
    """Blosc shuffles types of up to 255 bytes."""
    return 1 <= itemsize <= 255


def set_blosc(dcpl: h5p.PropDCID, itemsize: int, chunk_nbytes: int) -> None:
    """Add the Blosc filter (optional, as h5py adds plugin filters) to a dataset's pipeline."""
    dcpl.set_filter(BLOSC_FILTER, h5z.FLAG_OPTIONAL, blosc_parameters(itemsize, chunk_nbytes))


def blosc_parameters_problem(values: tuple[int, ...], chunks: tuple[int, ...]) -> str | None:
    """What is wrong with the Blosc filter parameters of a dataset with ``chunks``, or None.
    Accepted: hdf5-blosc's revisions 1 and 2, Blosc format 2, a type size of 1-255, a chunk
    size in bytes that is a whole number of bytes per value, level 0-9, shuffle 0-2 and
    compressors 0-5 (the last three optional, as hdf5-blosc reads them). The decompressed size
    of every chunk is checked against the dataset's type when the chunk is read."""
    values = tuple(int(v) for v in values)
    if not 4 <= len(values) <= 7:
        return f"{len(values)} parameters, not 4 to 7"
    limits = [(1, 2), (FORMAT, FORMAT), (1, 255), (1, 2**32 - 1), (0, 9), (0, 2), (0, 5)]
    names = ["filter revision", "Blosc format", "type size", "chunk size", "level", "shuffle",
             "compressor"]
    for value, (low, high), name in zip(values, limits, names):
        if not low <= value <= high:
            return f"{name} {value}, not {low}" + (f" to {high}" if high != low else "")
    if values[3] % max(1, math.prod(chunks)):
        return f"chunk size {values[3]} is not a whole number of bytes per value"
    return None


def blosc_fletcher32(dcpl: Any) -> bool | None:
    """When the dataset's filters are exactly Blosc, optionally followed by Fletcher-32:
    whether Fletcher-32 follows; else None."""
    codes = [dcpl.get_filter(i)[0] for i in range(dcpl.get_nfilters())]
    if codes == [BLOSC_FILTER]:
        return False
    if codes == [BLOSC_FILTER, h5z.FILTER_FLETCHER32]:
        return True
    return None


def check_blosc_filter(node: str, dcpl: Any, layout: int) -> None:
    """UnsafeFileError unless every Blosc filter in the pipeline has parameters lean_store
    accepts (:func:`blosc_parameters_problem`) for the dataset's chunks."""
    for i in range(dcpl.get_nfilters()):
        code, _flags, values = dcpl.get_filter(i)[:3]
        if code != BLOSC_FILTER:
            continue
        if layout != h5d.CHUNKED:
            raise UnsafeFileError(f"{node!r}: the Blosc filter on a dataset without chunks")
        problem = blosc_parameters_problem(values, tuple(dcpl.get_chunk()))
        if problem is not None:
            raise UnsafeFileError(f"{node!r}: unsupported Blosc filter parameters ({problem})")


def _encode(chunk: np.ndarray, itemsize: int, fletcher32: bool) -> bytes | np.ndarray:
    frame = compress(chunk, b"zstd", WEIGHTS_LEVEL, WEIGHTS_SHUFFLE, WEIGHTS_BLOCK_BYTES,
                     itemsize)
    return _FLETCHER32.encode(frame) if fletcher32 else frame


class BloscChunks:
    """Compress chunks on the writer's ``queue`` (shared by every dataset of a save, so that
    the chunks of one tensor compress while the ones before them are written), hand them to
    ``put(offset, payload)`` in order (the interface of
    :class:`lean_store.stores.hdf5.deflate.DeflateChunks`)."""

    def __init__(self, queue: OrderedPool, itemsize: int, fletcher32: bool,
                 put: Callable[[tuple[int, ...], Any], None]) -> None:
        self._itemsize = itemsize
        self._fletcher32 = fletcher32
        self._put = put
        self._queue = queue

    def submit(self, offset: tuple[int, ...], chunk: np.ndarray, *, copy: bool = True
               ) -> None:
        """Queue one full chunk (its bytes, padded to the chunk shape). It is copied for the
        workers, so the caller may reuse ``chunk``'s memory as soon as this returns; with
        ``copy=False`` the workers read ``chunk`` itself, which must stay unchanged until the
        queue is flushed (a stable source's memory, for the whole save)."""
        if not self._queue.busy() and chunk.nbytes < INLINE_BYTES:  # not worth a hand-off
            self._put(offset, _encode(chunk, self._itemsize, self._fletcher32))
            return
        self._queue.submit(functools.partial(self._put, offset), _encode,
                           chunk.copy() if copy else chunk, self._itemsize, self._fletcher32)



_FRAMES = threading.local()  # per thread: a reused buffer for stored chunks read with pread


def _stored_chunk(node: str, dsid: Any, start: tuple[int, ...], chunk_nbytes: int,
                  fletcher32: bool, fd: int | None, file_size: int) -> tuple[int, np.ndarray]:
    """(filter mask, stored bytes) of the chunk at ``start``: with one ``pread`` from its file
    offset through HDF5's own descriptor ``fd`` into a reused buffer (offset and size checked
    against the file and the most a frame of the chunk can take), else ``H5Dread_chunk``."""
    try:
        with chunk_lock():
            if fd is None:
                mask, raw = dsid.read_direct_chunk(start)
                return mask, np.frombuffer(raw, np.uint8)
            info = dsid.get_chunk_info_by_coord(start)
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        raise IntegrityError(f"{tensor_ref(node)}: HDF5 chunk at {start} unreadable ({exc})"
                             ) from None
    offset, size = info.byte_offset, info.size
    limit = frame_size_limit(chunk_nbytes) + (4 if fletcher32 else 0)
    if offset is None or size is None or size > limit or offset + size > file_size:
        raise IntegrityError(f"{tensor_ref(node)}: HDF5 chunk at {start} has a bad chunk record "
                             f"({offset}, {size} bytes; at most {limit}, file {file_size})")
    return int(info.filter_mask), _pread_frame(node, fd, offset, size, limit, start)


def _pread_frame(node: str, fd: int, offset: int, size: int, limit: int,
                 start: tuple[int, ...]) -> np.ndarray:
    """``size`` stored bytes at ``offset`` read with one ``pread`` into this thread's reused
    buffer (of at least ``limit`` bytes, the most a chunk's frame takes)."""
    buf = getattr(_FRAMES, "buf", None)
    if buf is None or buf.size < size:
        buf = _FRAMES.buf = np.empty(max(limit, 0 if buf is None else buf.size), np.uint8)
    stored = buf[:size]
    try:
        got = os.preadv(fd, [stored], offset)  # type: ignore[list-item]  # numpy stubs: __buffer__ 3.12+
    except OSError as exc:
        raise IntegrityError(f"{tensor_ref(node)}: HDF5 chunk at {start} unreadable ({exc})"
                             ) from None
    if got != size:
        raise IntegrityError(f"{tensor_ref(node)}: HDF5 chunk at {start} is truncated")
    return stored


def read_blosc_chunk(node: str, dsid: Any, start: tuple[int, ...], chunk_nbytes: int,
                     fletcher32: bool, dst: np.ndarray, fd: int | None = None,
                     file_size: int = 0) -> None:
    """The chunk at ``start`` of a Blosc dataset, decompressed into ``dst`` (flat uint8: the
    whole chunk, or a prefix of it); read with ``pread`` through HDF5's descriptor ``fd`` of a
    file of ``file_size`` bytes when given, else ``H5Dread_chunk``, and decompressed by
    numcodecs: no HDF5 filter is needed. A chunk whose filter mask skips Blosc is refused:
    hdf5-blosc never skips it, and lean_store never lets HDF5 run a pipeline holding a filter
    it would load as a plugin."""
    mask, stored = _stored_chunk(node, dsid, start, chunk_nbytes, fletcher32, fd, file_size)
    if mask != 0:
        raise IntegrityError(f"{tensor_ref(node)}: HDF5 chunk at {start} skips filters (mask "
                             f"{mask:#x}); Blosc chunks are never stored so")
    _decode_stored(node, start, stored, chunk_nbytes, fletcher32, dst)


def read_blosc_at(node: str, fd: int, offset: int, size: int, chunk_nbytes: int,
                  fletcher32: bool, dst: np.ndarray, start: tuple[int, ...]) -> None:
    """The one chunk of a Blosc dataset whose chunk record (read from the file's bytes by
    :mod:`.header_layout`, mask 0, ``size`` checked against the file and the most a frame of
    the chunk takes) gives ``offset``: one ``pread`` through HDF5's descriptor ``fd``, then
    checked and decompressed into ``dst`` as :func:`read_blosc_chunk` does (``start``: the
    chunk's position, for errors)."""
    limit = frame_size_limit(chunk_nbytes) + (4 if fletcher32 else 0)
    _decode_stored(node, start, _pread_frame(node, fd, offset, size, limit, start),
                   chunk_nbytes, fletcher32, dst)


def _decode_stored(node: str, start: tuple[int, ...], stored: np.ndarray, chunk_nbytes: int,
                   fletcher32: bool, dst: np.ndarray) -> None:
    """A stored chunk (its Blosc frame, then its Fletcher-32 when ``fletcher32``) checked and
    decompressed into ``dst``; IntegrityError when anything is wrong with it."""
    if fletcher32:
        try:
            stored = np.frombuffer(_FLETCHER32.decode(stored), np.uint8)
        except RuntimeError as exc:
            raise IntegrityError(f"{tensor_ref(node)}: HDF5 chunk at {start}: {exc}") from None
    problem = decode_frame(stored, chunk_nbytes, dst)
    if problem is not None:
        raise IntegrityError(f"{tensor_ref(node)}: HDF5 chunk at {start} {problem}; the file is "
                             "corrupt")


def read_blosc_region(node: str, dsid: Any, start: tuple[int, ...], count: tuple[int, ...],
                      chunks: tuple[int, ...], itemsize: int, fletcher32: bool,
                      out: np.ndarray, fd: int | None = None, file_size: int = 0) -> bool:
    """The region ``start``/``count`` (at the origin of a chunk, inside it) of a Blosc
    dataset into the C-contiguous ``out``; straight into ``out`` when the region is a prefix
    of the chunk's bytes (a whole chunk, or a row-block edge chunk). Always True."""
    chunk_nbytes = math.prod(chunks) * itemsize
    flat = out.reshape(-1).view(np.uint8)
    clipped = [i for i, (n, c) in enumerate(zip(count, chunks)) if n < c]
    if not clipped or (len(clipped) == 1 and all(c == 1 for c in chunks[: clipped[0]])):
        read_blosc_chunk(node, dsid, start, chunk_nbytes, fletcher32, flat, fd, file_size)
        return True
    scratch = np.empty(chunk_nbytes, np.uint8)
    read_blosc_chunk(node, dsid, start, chunk_nbytes, fletcher32, scratch, fd, file_size)
    item = np.dtype((np.void, itemsize))
    flat.view(item).reshape(count)[...] = scratch.view(item).reshape(chunks)[
        tuple(slice(0, n) for n in count)]
    return True


__all__ = [
    "BLOSC_FILTER", "BloscChunks", "blosc_parameters", "blosc_parameters_problem",
    "blosc_fletcher32", "can_blosc", "check_blosc_filter", "read_blosc_at", "read_blosc_chunk",
    "read_blosc_region", "set_blosc",
]
