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

``compression="weights"`` adds one codec between the two, ``blosc`` (zstd, byte shuffle by the
word width, 1 MiB blocks): each (padded) chunk is then the Blosc 1 frame
``numcodecs.blosc.compress`` returns for it with the codec's parameters (zarr's ``BloscCodec``
calls the same function with the same arguments; the frames are deterministic), followed by the
CRC-32C of the frame. The chunks of a shard are compressed on a small thread pool (numcodecs
releases the GIL), like the HDF5 backend's Blosc chunks.

``tests/stores/test_zarr_crc.py`` checks the files are identical to zarr's for aligned, edge and
sharded arrays, and that stock ``zarr.open_group`` reads them;
``tests/stores/test_zarr_weights_direct_write.py`` does the same for ``"weights"``.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np

from ...chunking import Region
from ...integrity import crc32c_combine, crc32c_extend, crc32c_of
from ..blosc_frames import compress
from ..ordered_pool import OrderedPool
from . import shard_index
from .chunk_keys import default_chunk_key, key_separator
from .compat import (
    BLOSC_SHUFFLES,
    chunk_key,
    codec_documents,
    plain_codecs,
    sharding_document,
)

INLINE_BYTES = 64 << 10  # chunks smaller than this are compressed on the caller


def _crc_bytes(data: Any) -> bytes:
    return int(google_crc32c.value(data)).to_bytes(4, "little")


def _word(crc: int) -> bytes:
    """A stored CRC-32C word: little endian uint32."""
    return int(crc).to_bytes(4, "little")



_O_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
_WRITEV_MAX = 1024  # buffers per writev (IOV_MAX on Linux)


def write_all(fd: int, pieces: list[Any]) -> None:
    """Write ``pieces`` (buffers) in order at ``fd``'s position: one ``writev`` (at most
    ``_WRITEV_MAX`` buffers a call), resumed after a short write."""
    views = [v for v in (memoryview(p).cast("B") for p in pieces) if v.nbytes]
    first = 0
    while first < len(views):
        done = os.writev(fd, views[first: first + _WRITEV_MAX])
        while first < len(views) and done >= views[first].nbytes:
            done -= views[first].nbytes
            first += 1
        if done:  # a short write ended inside this buffer
            views[first] = views[first][done:]


def make_dirs(folder: str) -> None:
    """``folder`` and any missing parents (a fresh tree: usually one or two ``mkdir``)."""
    try:
        os.mkdir(folder)
    except FileExistsError:
        return
    except FileNotFoundError:
        make_dirs(folder.rpartition("/")[0])
        os.mkdir(folder)


@dataclass(frozen=True)
class BloscSettings:
    """The parameters of a ``blosc`` codec document, as numcodecs' ``compress`` takes them."""

    cname: bytes
    clevel: int
    shuffle: int
    blocksize: int
    typesize: int

    def compress(self, chunk: np.ndarray) -> bytes:
        return compress(chunk, self.cname, self.clevel, self.shuffle, self.blocksize,
                        self.typesize)


_CNAMES = ("blosclz", "lz4", "lz4hc", "zlib", "zstd")


def _int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def blosc_settings(codec: dict[str, Any]) -> BloscSettings | None:
    """The settings of a ``blosc`` codec document that states every parameter, else None."""
    config = codec.get("configuration") or {}
    if codec.get("name") != "blosc" or set(config) != {
            "typesize", "cname", "clevel", "shuffle", "blocksize"}:
        return None
    cname, shuffle = config["cname"], config["shuffle"]
    if cname not in _CNAMES or shuffle not in BLOSC_SHUFFLES \
            or not _int_in(config["clevel"], 0, 9) or not _int_in(config["typesize"], 1, 255) \
            or not _int_in(config["blocksize"], 0, 2**31 - 1):
        return None
    return BloscSettings(cname.encode(), config["clevel"], BLOSC_SHUFFLES[shuffle],
                         config["blocksize"], config["typesize"])


def _chunk_codecs(codecs: list[dict[str, Any]]) -> tuple[bool, BloscSettings | None]:
    """(whether the direct writer writes chunks of these codecs, their Blosc settings): plain
    ``bytes`` + ``crc32c``, or ``bytes`` + ``blosc`` + ``crc32c``."""
    if plain_codecs(codecs):
        return True, None
    if len(codecs) != 3:
        return False, None
    settings = blosc_settings(codecs[1])
    if settings is None or not plain_codecs([codecs[0], codecs[2]]):
        return False, None
    return True, settings


def _inner_codecs(array: Any) -> list[dict[str, Any]]:
    shard = sharding_document(array)
    return codec_documents(array) if shard is None else list(shard.get("codecs") or [])


class DirectWriter:
    """Writes whole shards (or whole unsharded chunks) of one zarr array as files; ``array`` is
    the zarr array or its metadata document (``zarr_compat.plain_array_document``)."""

    def __init__(
        self, root: Path, array: Any, chunks: tuple[int, ...], shards: tuple[int, ...] | None,
        itemsize: int, linker: Any = None, queue: OrderedPool | None = None,
        *, plain: bool = False,
    ) -> None:
        """``plain``: ``array`` is a document of uncompressed chunks (``bytes`` +
        ``crc32c``) that :func:`.compat.plain_array_document` built."""
        self._root = os.fspath(root)
        # None: uncompressed chunks (a plain document without a compressor: by construction)
        self._blosc = None if plain else _chunk_codecs(_inner_codecs(array))[1]
        # a plain document states the default chunk key encoding (by construction): its
        # separator, for keys made without a call per file
        self._separator = key_separator(array) if plain else None
        self._queue = queue  # Blosc chunks compressed on its pool (else on the caller)
        self._array = array
        self._linker = linker  # incremental steps: a lean_store.stores.zarr.incremental.UnitLinker
        self._chunks = chunks
        self._shards = shards
        self._chunk_nbytes = math.prod(chunks) * itemsize
        self._made: set[str] = set()

    def write(self, region: Region, data: np.ndarray, crc: Any = None) -> int | None:
        """Write the file of the shard (or chunk) whose clipped region is ``region``;
        ``data`` holds its C-contiguous little-endian bytes. A compressed chunk file of an
        unsharded array may be written later (its bytes copied first), by the queue.
        ``crc``: the CRC-32C of ``data`` when the caller has it (an int, or a callable giving
        it once computed): an unsharded uncompressed chunk then takes it instead of a second
        pass over its bytes. Returns the chunk's CRC-32C when its file was linked to an equal
        one of the previous step (an incremental step: the linker checks the file's
        stored word against ``crc``)."""
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        key, path = self._unit_path(region)
        pieces: list[Any] = []
        if self._shards is None:
            if self._blosc is not None and self._queue is not None and (
                    self._queue.busy() or flat.size >= INLINE_BYTES):
                self._queue.submit(lambda pieces: self._put(path, key, pieces),
                                   self._chunk_pieces, flat.copy())
                return None
            if self._blosc is None and crc is not None:
                pad = self._chunk_nbytes - flat.size  # an edge chunk: zarr pads it with 0
                if not pad:
                    pieces += [flat, self._crc_piece(0, crc)]
                    word = self._put(path, key, pieces)  # the linked file's word (checked)
                    return None if word is None else int.from_bytes(word, "little")
                pieces += [flat, np.zeros(pad, np.uint8), self._crc_piece(pad, crc)]
            else:
                pieces += self._chunk_pieces(flat)
        else:
            pieces += self._unit_pieces(flat)
        self._put(path, key, pieces)
        return None

    def _unit_pieces(self, flat: np.ndarray) -> list[Any]:
        """The stored pieces of the unit ``flat``: its chunk (unsharded), or its shard's
        chunks and index."""
        if self._shards is None:
            return self._chunk_pieces(flat)
        size = self._chunk_nbytes
        per_shard = math.prod(s // c for s, c in zip(self._shards, self._chunks))
        parts = [flat[j * size: (j + 1) * size] for j in range(per_shard)]
        parts = [p for p in parts if p.size]  # row blocks: the chunks inside the array
        index = shard_index.empty(per_shard)
        pieces: list[Any] = []
        offset = 0
        for j, chunk in enumerate(self._encoded(parts)):
            nbytes = sum(len(memoryview(p)) for p in chunk)
            index[j] = (offset, nbytes)
            offset += nbytes
            pieces += chunk
        pieces += shard_index.encode(index)
        return pieces

    def write_later(self, region: Region, data: np.ndarray,
                    submit: Callable[..., Future[int]]) -> Future[int] | None:
        """Start the file of the uncompressed shard (or chunk) ``region`` on a worker:
        ``submit(fn, *args)`` runs ``fn(*args)`` there (a thread pool's ``submit``). The
        future gives the CRC-32C of ``data``, which must stay unchanged until it is done. The
        file's bytes are those :meth:`write` writes; its folders are made here, on the
        caller's thread. In an incremental step the worker compares the unit with the
        previous step's file and links or writes it (:meth:`write`). A compressed unit is
        compressed on that worker too, from ``data`` itself: no copy, as :meth:`write` makes
        for its queue (``data`` stays unchanged until the future is done)."""
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        key, path = self._unit_path(region)
        if self._blosc is not None:
            return submit(self._write_compressed, key, path, flat)
        if self._linker is not None:
            return submit(self._link_or_write, region, flat)
        return submit(self._write_plain, path, flat)

    def _write_compressed(self, key: str, path: str, flat: np.ndarray) -> int:
        """The file of the compressed unit ``flat`` (folders made), on a worker: its chunks
        compressed here (a shard's on the Blosc pool as well), then written or, in an
        incremental step, linked to the previous step's equal file. Returns the CRC-32C of
        ``flat``."""
        crc = crc32c_of(flat)
        self._put(path, key, self._unit_pieces(flat))
        return crc

    def _link_or_write(self, region: Region, flat: np.ndarray) -> int:
        """The unit ``region`` of an incremental step, on a worker: its CRC-32C, then
        :meth:`write` (linked to the previous step's equal file, else written). Returns the
        CRC-32C of ``flat``."""
        crc = crc32c_of(flat)
        self.write(region, flat, crc)
        return crc

    def _write_plain(self, path: str, flat: np.ndarray) -> int:
        """The file of an uncompressed unit ``flat``: each chunk's CRC-32C computed just
        before the chunk is written (its bytes then come from the cache), one ``writev`` per
        chunk, the shard index last. Returns the CRC-32C of ``flat``."""
        size = self._chunk_nbytes
        if self._shards is None:
            parts = [flat]
            index = None
        else:
            per_shard = math.prod(s // c for s, c in zip(self._shards, self._chunks))
            parts = [p for p in (flat[j * size: (j + 1) * size] for j in range(per_shard))
                     if p.size]  # row blocks: the chunks inside the array
            index = shard_index.empty(per_shard)
        unit_crc = 0
        fd = os.open(path, _O_CREATE, 0o666)
        try:
            for j, part in enumerate(parts):
                crc = crc32c_extend(0, part)
                unit_crc = crc32c_combine(unit_crc, crc, part.size)
                pad = size - part.size  # an edge chunk: zarr pads it with the fill value 0
                if pad:
                    zeros = np.zeros(pad, np.uint8)
                    write_all(fd, [part, zeros, _word(google_crc32c.extend(crc, zeros))])
                else:
                    write_all(fd, [part, _word(crc)])
                if index is not None:
                    index[j] = (j * (size + 4), size + 4)
            if index is not None:
                write_all(fd, shard_index.encode(index))
        finally:
            os.close(fd)
        return unit_crc

    def _unit_path(self, region: Region) -> tuple[str, str]:
        """(key, path) of the unit file of ``region``, its folders made."""
        unit = self._shards or self._chunks
        coords = tuple(s.start // u for s, u in zip(region, unit))
        sep = self._separator
        key = default_chunk_key(sep, coords) if sep is not None \
            else chunk_key(self._array, coords)
        path = f"{self._root}/{key}"
        folder = path.rpartition("/")[0]
        if folder not in self._made:  # the array's own (keys "c.0.0"): one mkdir
            make_dirs(folder)
            self._made.add(folder)
        return key, path

    @property
    def made_folders(self) -> bool:
        """Whether a chunk file was written (its folders, the array's among them, exist)."""
        return bool(self._made)

    @staticmethod
    def _crc_piece(pad: int, crc: Any) -> Any:
        """The stored CRC-32C word of a chunk whose bytes have the CRC ``crc`` (an int, or a
        callable giving it) before ``pad`` zero bytes of padding; a callable piece while
        ``crc`` is still being computed (resolved once the chunk's bytes are out)."""

        def word() -> bytes:
            value = crc() if callable(crc) else crc
            if pad:
                value = google_crc32c.extend(value, bytes(pad))
            return int(value).to_bytes(4, "little")

        return word if callable(crc) else word()

    def _put(self, path: str, key: str, pieces: list[Any]) -> bytes | None:
        """Create (or, in an incremental step, link) the unit file ``path`` holding ``pieces``
        in order, with one open and ``writev`` calls. A callable piece (a chunk's CRC-32C word
        still being computed on another thread) is resolved once the pieces before it are out.
        Returns what the previous step's file holds in place of the callable piece when the
        file was linked (equal to the callable's value: the linker checks it)."""
        if self._linker is not None:
            return self._linker.link_or_write(Path(path), key, pieces)
        fd = os.open(path, _O_CREATE, 0o666)
        try:
            start = 0
            for i, piece in enumerate(pieces):
                if callable(piece):
                    write_all(fd, pieces[start:i])
                    write_all(fd, [piece()])
                    start = i + 1
            write_all(fd, pieces[start:])
        finally:
            os.close(fd)
        return None

    def _encoded(self, parts: list[np.ndarray]) -> list[list[Any]]:
        """Each chunk's stored pieces; Blosc chunks of a shard compressed on the pool."""
        if self._blosc is None or self._queue is None or len(parts) < 2 \
                or self._chunk_nbytes < INLINE_BYTES:
            return [self._chunk_pieces(p) for p in parts]
        return list(self._queue.pool.map(self._chunk_pieces, parts))

    def _chunk_pieces(self, flat: np.ndarray) -> list[Any]:
        if flat.size < self._chunk_nbytes:  # an edge chunk: zarr pads it with the fill value 0
            full = np.zeros(self._chunk_nbytes, np.uint8)
            full[: flat.size] = flat
            flat = full
        if self._blosc is not None:
            frame = self._blosc.compress(flat)
            return [frame, _crc_bytes(frame)]
        return [flat, _crc_bytes(flat)]


def direct_ok(array: Any, *, compressed: bool = False) -> bool:
    """True when ``array``'s codecs are exactly a layout :class:`DirectWriter` writes: plain
    ``bytes`` + ``crc32c`` chunks, or with ``compressed`` also ``bytes`` + ``blosc`` (every
    parameter stated) + ``crc32c`` (what ``compression="weights"`` writes)."""
    if sys.byteorder != "little":
        return False

    def fits(codecs: list[dict[str, Any]]) -> bool:
        ok, settings = _chunk_codecs(codecs)
        return ok and (compressed or settings is None)

    shard = sharding_document(array)
    if shard is None:
        return fits(codec_documents(array))
    return (
        len(codec_documents(array)) == 1
        and fits(list(shard.get("codecs") or []))
        and plain_codecs(shard.get("index_codecs") or [])
        and shard.get("index_location", "end") == "end"
    )


__all__ = ["BloscSettings", "DirectWriter", "blosc_settings", "direct_ok", "make_dirs",
           "write_all"]
