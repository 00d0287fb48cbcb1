"""Reading Zarr v3 chunks straight from the files of the direct layout (``zarr_direct``).

For arrays whose codecs are exactly what :class:`.direct_write.DirectWriter` writes
(``bytes`` little endian + ``crc32c``, optionally inside ``sharding_indexed`` with a
``bytes`` + ``crc32c`` index at the end, row-block chunks inside a shard), a read goes to the
files themselves instead of zarr's codec pipeline: for each chunk the selection touches, the
shard index is read and its CRC-32C checked (once per shard), the chunk's bytes are read with
one ``preadv`` straight into the output where the chunk is wanted whole (else into a scratch
chunk), and its CRC-32C is checked before anything is returned. Only the chunks a selection
touches are read. Every offset and length is bounded by the bytes actually in the file; a
missing file or chunk, a bad index or a bad CRC is an :class:`IntegrityError`.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import google_crc32c
import numpy as np

from ...chunking import chunk_number, touched_cells
from ...errors import IntegrityError
from ...integrity import crc32c_extend
from ...naming import tensor_ref
from . import shard_index
from .blosc_read import blosc_layout, decode_chunk, stored_size_limit, stored_size_ok
from .compat import chunk_key, regular_grid, sharding_document
from .direct_write import direct_ok
from .plain import PlainArray

_O_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _inner_chunks(doc: dict[str, Any]) -> tuple[int, ...] | None:
    shard = sharding_document(doc)
    shape = (shard or {}).get("chunk_shape") if shard is not None else regular_grid(doc)
    if not isinstance(shape, (list, tuple)) or not all(isinstance(c, int) for c in shape):
        return None
    return tuple(shape)


def direct_read_ok(array: Any, doc: dict[str, Any] | None = None) -> bool:
    """True when ``array`` is stored in the layout :class:`DirectReader` reads. ``doc``: the
    array's metadata document, when the caller has it (else it is built from ``array``)."""
    if isinstance(array, PlainArray):
        return True  # recognised as the direct layout when it was described
    desc = array if doc is None else doc
    outer = regular_grid(desc)
    if not (direct_ok(desc) or blosc_layout(desc)) or outer is None:
        return False
    inner = tuple(int(c) for c in array.chunks)
    if doc is not None and _inner_chunks(doc) != inner:
        return False
    if len(outer) != len(inner) or any(o % c for o, c in zip(outer, inner)):
        return False
    return sum(o != c for o, c in zip(outer, inner)) <= 1  # one chunk axis: plain order


class DirectReader:
    """Reads selections of one array from its chunk (shard) files under ``node``, opened
    relative to the store's root directory ``root_fd``: the tree that directory was when
    opened, even after a save has renamed another one into its place."""

    def __init__(self, root_fd: int, node: str, array: Any, doc: dict[str, Any] | None = None,
                 frames: threading.local | None = None) -> None:
        """``frames``: per-thread scratch for compressed chunks, shared by the readers of
        one store (one buffer per thread, not per array)."""
        self._root_fd = root_fd
        self._node = node
        if isinstance(array, PlainArray):  # checked when it was described: no re-parsing
            shape, chunks = array.shape, array.chunks  # tuples of ints already
            self._outer, self._blosc = array.grid, array.compressed
            self._key: Callable[[tuple[int, ...]], str] = array.key
        else:
            shape = tuple(int(d) for d in array.shape)
            chunks = tuple(int(c) for c in array.chunks)
            self._key = partial(chunk_key, array)
            self._outer = regular_grid(array if doc is None else doc) or chunks
            # compression="weights": each stored chunk is a Blosc frame + CRC-32C,
            # decompressed here (stores/zarr/blosc_read.py) instead of by zarr's codec pipeline
            self._blosc = blosc_layout(array if doc is None else doc)
        self._shape, self._chunks = shape, chunks
        self._sharded = self._outer != chunks
        self._itemsize = int(array.dtype.itemsize)
        self._chunk_nbytes = math.prod(chunks) * self._itemsize
        self._array = array
        self._indexes: dict[tuple[int, ...], np.ndarray] = {}
        self._origin, self._ones = (0,) * len(shape), (1,) * len(shape)
        if shape == chunks and not self._sharded:  # one chunk, the array's own shape
            self._per_shard = self._grid = (1,) * len(shape)
            self._slots = 1
            # one chunk holds the whole, non-empty array
            self._one_chunk = self._crc_ok = 0 not in shape
        else:
            self._per_shard = tuple(o // c for o, c in zip(self._outer, chunks))
            self._slots = math.prod(self._per_shard)
            self._grid = tuple(-(-d // c) for d, c in zip(shape, chunks))
            # one chunk (a prefix of its bytes: row-block edge) holds the whole, non-empty array
            self._one_chunk = all(g == 1 for g in self._grid) and all(shape) \
                and self._is_prefix(shape)
            edge = tuple(d - (g - 1) * c for d, c, g in zip(shape, chunks, self._grid))
            self._crc_ok = all(self._grid) and self._is_prefix(edge)
        self._crc_ok = self._crc_ok and not self._blosc
        # chunk number (C order) -> CRC-32C of the words of that chunk as last read (checked,
        # or to be checked by :meth:`check_chunk`): the digest of a whole-tensor read follows
        self.word_crcs: dict[int, int | None] = {}
        self._unchecked: dict[int, int] = {}  # chunk number -> its stored CRC, not yet checked
        self._frames = threading.local() if frames is None else frames

    def read(self, start: tuple[int, ...], count: tuple[int, ...], step: tuple[int, ...],
             out: np.ndarray) -> None:
        """Fill the C-contiguous ``out`` (``count`` elements over the stored rank, raw bytes
        of the array's items) with the selection ``start/count/step``."""
        # items as opaque void scalars: no extra axis, so rank-32 tensors stay within numpy 1's
        # 32-dimension limit
        flat = out.reshape(-1).view(np.uint8)
        if self._one_chunk and count == self._shape and start == self._origin \
                and step == self._ones:  # the whole array, one chunk: its one read
            self.word_crcs[0] = self._read_chunk(self._origin, flat)
            return
        item = np.dtype((np.void, self._itemsize))
        dst_all = flat.view(item).reshape(count)
        scratch: np.ndarray | None = None
        for coords in touched_cells(start, count, step, self._chunks, self._shape):
            cstart = tuple(i * c for i, c in zip(coords, self._chunks))
            ccount = tuple(min(c, d - a) for a, c, d in zip(cstart, self._chunks, self._shape))
            if cstart == start and ccount == count and all(s == 1 for s in step) \
                    and self._is_prefix(ccount):
                self.word_crcs[chunk_number(coords, self._grid)] = self._read_chunk(coords, flat)
                continue
            if scratch is None:
                scratch = np.empty(self._chunk_nbytes, np.uint8)
            self._read_chunk(coords, scratch)
            items = scratch.view(item)
            if self._is_prefix(ccount):
                chunk = items[: math.prod(ccount)].reshape(ccount)
            else:  # clipped on an axis other than the first split one
                chunk = items.reshape(self._chunks)[tuple(slice(0, n) for n in ccount)]
            dst, src = [], []
            for a, n, st, ca, cn in zip(start, count, step, cstart, ccount):
                k0 = max(0, -(-(ca - a) // st))
                k1 = min(n, (ca + cn - 1 - a) // st + 1)
                dst.append(slice(k0, k1))
                src.append(slice(a + k0 * st - ca, a + (k1 - 1) * st - ca + 1, st))
            dst_all[tuple(dst)] = chunk[tuple(src)]

    def words_crc_ok(self) -> bool:
        """Whether every whole-chunk read of this array records its words' CRC-32C in
        :attr:`word_crcs`: uncompressed chunks whose part inside the array (at its edge too)
        is a prefix of the chunk's bytes (row blocks)."""
        return self._crc_ok

    def read_unchecked(self, start: tuple[int, ...], out: np.ndarray) -> bool:
        """The whole chunk at ``start`` into the C-contiguous ``out`` without its CRC-32C
        check, left to :meth:`check_chunk`: only a full chunk (no padding: its stored CRC is
        its words'), uncompressed. False (nothing read) for any other chunk."""
        coords = tuple(a // c for a, c in zip(start, self._chunks))
        if self._blosc or out.nbytes != self._chunk_nbytes \
                or tuple(i * c for i, c in zip(coords, self._chunks)) != tuple(start) \
                or any(i >= g for i, g in zip(coords, self._grid)):
            return False
        number = chunk_number(coords, self._grid)
        stored = self._read_chunk(coords, out.reshape(-1).view(np.uint8), check=False)
        assert stored is not None  # uncompressed: the stored CRC
        self.word_crcs[number] = self._unchecked[number] = stored
        return True

    def check_chunk(self, number: int, words: np.ndarray) -> None:
        """Check ``words``, read by :meth:`read_unchecked` as chunk ``number``, against the
        CRC-32C stored with it; a chunk read checked already: nothing to do."""
        stored = self._unchecked.pop(number, None)
        if stored is None:
            return
        crc = crc32c_extend(0, words.reshape(-1).view(np.uint8))
        if crc != stored:
            coords = tuple(int(c) for c in np.unravel_index(number, self._grid))
            raise self._fail(coords, f"fails its crc32c check (computed {crc:#010x})")

    def _is_prefix(self, ccount: tuple[int, ...]) -> bool:
        """The clipped chunk's elements are a prefix of the chunk's bytes in C order."""
        clipped = [i for i, (n, c) in enumerate(zip(ccount, self._chunks)) if n < c]
        return not clipped or (len(clipped) == 1 and all(
            c == 1 for c in self._chunks[: clipped[0]]
        ))

    def _fail(self, coords: tuple[int, ...], what: str) -> IntegrityError:
        return IntegrityError(f"{tensor_ref(self._node)}: chunk {coords} {what}; the checkpoint is "
                              "corrupt or truncated")

    def _read_chunk(self, coords: tuple[int, ...], dst: np.ndarray, check: bool = True
                    ) -> int | None:
        """The chunk's bytes into ``dst`` (a flat uint8 array: the whole chunk, or the prefix
        the array holds of an edge chunk), CRC-32C checked over the whole stored chunk.
        Returns the CRC-32C of ``dst``'s bytes (None for a compressed chunk); with ``check``
        False (a full uncompressed chunk), the stored CRC-32C, unchecked."""
        size = self._chunk_nbytes
        if self._sharded:
            shard = tuple(c // p for c, p in zip(coords, self._per_shard))
            inner = tuple(c % p for c, p in zip(coords, self._per_shard))
            key = self._key(shard)
        else:
            shard, inner, key = coords, (), self._key(coords)
        try:
            fd = os.open(f"{self._node}/{key}", _O_FLAGS, dir_fd=self._root_fd)
        except OSError as exc:
            raise self._fail(coords, f"cannot be read: file {key!r} ({exc.strerror})") from None
        try:
            if not self._sharded and not self._blosc:
                # the file is the chunk and its CRC: read with one byte more than it should
                # hold, so that a longer file shows without an fstat
                pad = size - dst.size
                tail: Any = bytearray(pad + 5)  # the padding, the CRC and one byte more
                got = os.preadv(fd, [dst, tail], 0)  # type: ignore[list-item]  # numpy stubs: __buffer__ 3.12+
                if got != size + 4:
                    has = f"more than {size + 4}" if got > size + 4 else str(got)
                    raise self._fail(coords, f"file {key!r} has {has} bytes, not {size + 4}")
            else:
                got, nbytes, stored, tail, pad = self._read_part(fd, key, shard, inner, coords, dst)
        except OSError as exc:
            raise self._fail(coords, f"cannot be read ({exc})") from None
        finally:
            os.close(fd)
        if self._blosc:
            problem = (f"is truncated ({got} of {nbytes} bytes)" if got != nbytes
                       else decode_chunk(stored, size, dst))
            if problem is not None:
                raise self._fail(coords, problem)
            return None
        if got != size + 4:
            raise self._fail(coords, f"is truncated ({got} of {size + 4} bytes)")
        recorded = int.from_bytes(bytes(tail[pad:pad + 4]), "little")
        if not check:
            return recorded
        words = crc32c_extend(0, dst)
        crc = google_crc32c.extend(words, bytes(tail[:pad])) if pad else words
        if crc != recorded:
            raise self._fail(coords, f"fails its crc32c check (computed {crc:#010x})")
        return words

    def _read_part(self, fd: int, key: str, shard: tuple[int, ...], inner: tuple[int, ...],
                   coords: tuple[int, ...], dst: np.ndarray) -> tuple[Any, ...]:
        """Read a chunk out of a shard file, or a compressed chunk's file: (bytes read, bytes
        stored, the Blosc frame read or None, the uncompressed chunk's tail (padding and
        CRC) or None, its padding length)."""
        size = self._chunk_nbytes
        file_size = os.fstat(fd).st_size
        if self._sharded:
            index = self._index(fd, file_size, shard, coords)
            offset, nbytes = (int(v) for v in index[int(np.ravel_multi_index(
                inner, self._per_shard))])
            if shard_index.is_empty(offset, nbytes):
                raise self._fail(coords, f"is missing from shard {key!r}")
            end = file_size - shard_index.index_bytes(self._slots)
            if not self._size_ok(nbytes) or offset > end or offset + nbytes > end:
                raise self._fail(coords, f"has a bad shard index entry ({offset}, {nbytes})")
        else:
            offset, nbytes = 0, file_size
            if not self._size_ok(file_size):
                want = f"a Blosc frame of {size}" if self._blosc else str(size + 4)
                raise self._fail(coords, f"file {key!r} has {file_size} bytes, not {want}")
        if self._blosc:  # a compressed chunk: read whole, checked, then decompressed
            stored = self._frame_buffer(nbytes)
            got = os.preadv(fd, [stored], offset)  # type: ignore[list-item]  # numpy stubs: __buffer__ 3.12+
            return got, nbytes, stored, None, 0
        pad = size - dst.size
        tail = np.empty(pad + 4, np.uint8)  # google_crc32c takes numpy arrays and bytes
        got = os.preadv(fd, [dst, tail], offset)  # type: ignore[list-item]  # numpy stubs: __buffer__ 3.12+
        return got, nbytes, None, tail, pad

    def _frame_buffer(self, nbytes: int) -> np.ndarray:
        """This thread's buffer for a stored chunk of ``nbytes`` (at most a chunk and a
        frame's overhead, :meth:`_size_ok`), reused: no fresh pages per chunk."""
        buf = getattr(self._frames, "buf", None)
        if buf is None or buf.size < nbytes:
            buf = self._frames.buf = np.empty(
                max(stored_size_limit(self._chunk_nbytes), 0 if buf is None else buf.size),
                np.uint8)
        return buf[:nbytes]

    def _size_ok(self, nbytes: int) -> bool:
        """A stored chunk (data and CRC) of ``nbytes`` fits this array's chunks."""
        if self._blosc:
            return stored_size_ok(nbytes, self._chunk_nbytes)
        return nbytes == self._chunk_nbytes + 4

    def _index(self, fd: int, file_size: int, shard: tuple[int, ...], coords: tuple[int, ...]
               ) -> np.ndarray:
        index = self._indexes.get(shard)
        if index is None:
            n = shard_index.index_bytes(self._slots)
            if file_size < n:
                raise self._fail(coords, f"lies in a shard of {file_size} bytes, too short for "
                                         "its index")
            index = shard_index.decode(os.pread(fd, n, file_size - n), self._slots)
            if index is None:
                raise self._fail(coords, "lies in a shard whose index fails its crc32c check")
            self._indexes[shard] = index
        return index


__all__ = ["DirectReader", "direct_read_ok"]
