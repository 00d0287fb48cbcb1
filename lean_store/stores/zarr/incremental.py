"""Incremental Zarr steps: a chunk or shard file equal to the previous step's is hard-linked.

``Checkpointer(..., incremental=True)`` writes each step as a complete Zarr store, through the
usual atomic commit, but with a *base*: the previous committed step. For every write unit (one
shard file, or one chunk file when the array is not sharded) the writer compares what it would
write with the base's file at the same key, first by the CRC-32C words the file holds (a few
bytes read), then byte for byte; when both match it makes a hard link to the base's file in the
new step's temporary directory instead of writing it. Everything else, including every
``zarr.json``, is written as usual.

Why this is safe:

- the base is used only where the array's metadata (shape, data type, chunk grid, codecs, fill
  value: its ``zarr.json`` without attributes) is identical, and only for files whose bytes are
  identical, so the new step reads exactly as if it had been written in full;
- lean_store never writes into an existing file: the direct writer creates each unit file once
  in a fresh temporary directory, and zarr-python writes through a temporary file and a rename,
  so a linked inode is never modified, and no step can change another's data;
- a hard link is a second name of the same file: deleting a step (``keep_last``, by hand, or a
  killed save's leftover temporary) removes names, never data another step still names. Each
  step stays standalone for ``ls.open``, ``verify``, zarr-python, TensorStore and ``cp -r``.

HDF5 checkpoints are single files: a chunk cannot be shared without external or virtual
storage, which lean_store refuses to read for safety, so incremental steps are Zarr-only.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_CRC_BYTES = 4


@dataclass
class IncrementalStats:
    """What an incremental save wrote and what it linked (file bytes, not tensor bytes)."""

    written_files: int = 0
    written_bytes: int = 0
    linked_files: int = 0
    linked_bytes: int = 0


@dataclass(frozen=True)
class _Base:
    path: Path
    stats: IncrementalStats


_BASE: ContextVar[_Base | None] = ContextVar("lean_store_incremental_base", default=None)


@contextmanager
def linking_from(base: str | os.PathLike | None) -> Iterator[IncrementalStats]:
    """Zarr saves in this context (this thread or task) link unit files equal to ``base``'s
    (a committed Zarr store) instead of writing them; yields the running statistics."""
    stats = IncrementalStats()
    token = _BASE.set(None if base is None else _Base(Path(base), stats))
    try:
        yield stats
    finally:
        _BASE.reset(token)


def linker_for(new_array_dir: Path, node: str, metadata: dict[str, Any] | None = None
               ) -> UnitLinker | None:
    """The linker of one array being written at ``new_array_dir``, or None when no base is
    active or the base has no array ``node`` with the same metadata (``metadata``: the new
    array's document when its ``zarr.json`` is not written yet)."""
    base = _BASE.get()
    if base is None:
        return None
    base_dir = base.path / node
    try:
        if base_dir.is_symlink() or not base_dir.is_dir():
            return None
        old = _metadata(base_dir)
        if metadata is None:
            new = _metadata(new_array_dir)
        else:
            new = {k: v for k, v in metadata.items() if k != "attributes"}
    except (OSError, ValueError):
        return None
    if old is None or old != new:
        return None
    return UnitLinker(base_dir, new_array_dir, base.stats)


def _metadata(array_dir: Path) -> dict[str, Any] | None:
    meta = json.loads((array_dir / "zarr.json").read_text("utf-8"))
    if not isinstance(meta, dict) or meta.get("node_type") != "array":
        return None
    meta.pop("attributes", None)
    return meta


class UnitLinker:
    """Links one array's unit files to the base's identical files."""

    def __init__(self, base_dir: Path, new_dir: Path, stats: IncrementalStats) -> None:
        self._base_dir = base_dir
        self._new_dir = new_dir
        self.stats = stats

    def _base_file(self, key: str) -> Path | None:
        path = self._base_dir / key
        if path.is_symlink() or not path.is_file():
            return None
        return path

    def link_or_write(self, path: Path, key: str, pieces: list[Any]) -> bytes | None:
        """Create ``path`` (absent) holding ``pieces`` in order: as a hard link to the base's
        file at ``key`` when that holds exactly these bytes, else by writing them. A piece
        may be a callable giving its bytes (a chunk's CRC-32C word, computed only when
        asked): it is called only if the file is written. A linked file's word at that place
        is returned instead (the CRC of the bytes compared equal: no pass over them)."""
        base = self._base_file(key)
        same, word = (False, None) if base is None else _same_bytes(base, pieces)
        if same:
            assert base is not None
            os.link(base, path)
            self.stats.linked_files += 1
            self.stats.linked_bytes += sum(_size(p) for p in pieces)
            return word
        size = 0
        with open(path, "xb") as f:  # never into an existing file (it may be a link)
            for piece in pieces:
                size += f.write(piece() if callable(piece) else piece)
        self.stats.written_files += 1
        self.stats.written_bytes += size
        return None

    def link_if_same(self, key: str) -> None:
        """The unit file ``key`` was just written (by zarr, compressed): replace it with a hard
        link to the base's file when the bytes are identical (saves space, not the write)."""
        path = self._new_dir / key
        size = path.stat().st_size
        base = self._base_file(key)
        if base is not None and size >= _CRC_BYTES:
            data = np.fromfile(path, dtype=np.uint8)
            if _same_bytes(base, [data[: size - _CRC_BYTES], data[size - _CRC_BYTES:]])[0]:
                tmp = path.with_name(f".{path.name}.link")
                os.link(base, tmp)
                os.replace(tmp, path)
                self.stats.linked_files += 1
                self.stats.linked_bytes += size
                return
        self.stats.written_files += 1
        self.stats.written_bytes += size


def _libc_memcmp() -> Any:
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):  # pragma: no cover - platforms without a C library
        return None
    memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    memcmp.restype = ctypes.c_int
    return memcmp


_MEMCMP = _libc_memcmp()


def _equal_at(address: int, want: np.ndarray) -> bool:
    """The ``want.size`` bytes at ``address`` equal the contiguous uint8 array ``want``
    (memcmp: no temporary)."""
    if _MEMCMP is None:  # pragma: no cover
        return bytes((ctypes.c_char * want.size).from_address(address)) == want.tobytes()
    return _MEMCMP(address, want.ctypes.data, want.size) == 0


def _size(piece: Any) -> int:
    return _CRC_BYTES if callable(piece) else memoryview(piece).nbytes


def _same_bytes(base: Path, pieces: list[Any]) -> tuple[bool, bytes | None]:
    """(whether the file ``base`` holds ``pieces`` concatenated, what it holds in place of
    a callable piece). A callable piece is a chunk's CRC-32C word not computed yet: it is
    never called; the file's word there is the CRC of the bytes before it, which are
    compared with ours byte for byte. The CRC-32C words already known (pieces of 4 bytes:
    each chunk's crc32c, the shard index's) are compared first, so a changed unit costs a
    few small reads; then every byte (:func:`_file_holds`)."""
    try:
        fd = os.open(base, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False, None
    try:
        size = os.fstat(fd).st_size
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += _size(piece)
        if at != size:
            return False, None
        for offset, piece in zip(offsets, pieces):
            if not callable(piece) and _size(piece) == _CRC_BYTES \
                    and os.pread(fd, _CRC_BYTES, offset) != bytes(piece):
                return False, None
        for offset, piece in zip(offsets, pieces):
            if callable(piece) or _size(piece) == _CRC_BYTES:
                continue
            if not _file_holds(fd, offset, np.frombuffer(memoryview(piece).cast("B"), np.uint8)):
                return False, None
        words = [os.pread(fd, _CRC_BYTES, o) for o, p in zip(offsets, pieces) if callable(p)]
        if any(len(w) != _CRC_BYTES for w in words):
            return False, None
        return True, words[-1] if words else None
    except (OSError, ValueError):
        return False, None
    finally:
        os.close(fd)


_COMPARE_BYTES = 1 << 20
_scratch = threading.local()


def _file_holds(fd: int, offset: int, want: np.ndarray) -> bool:
    """The file ``fd`` holds the contiguous uint8 array ``want`` at ``offset``: read in windows
    of at most 1 MiB into one reused per-thread buffer (bounded memory) and compared with
    memcmp; a changed chunk stops at its first differing window. Read, not mapped: a file
    truncated meanwhile by another process reads short (a difference) where a mapping
    would raise SIGBUS and kill the process."""
    buf: bytearray | None = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = bytearray(_COMPARE_BYTES)
        _scratch.address = ctypes.addressof((ctypes.c_char * _COMPARE_BYTES).from_buffer(buf))
    address: int = _scratch.address
    at = 0
    while at < want.size:
        n = min(_COMPARE_BYTES, want.size - at)
        if os.preadv(fd, [memoryview(buf)[:n]], offset + at) != n:
            return False
        if not _equal_at(address, want[at: at + n]):
            return False
        at += n
    return True


__all__ = ["IncrementalStats", "UnitLinker", "linker_for", "linking_from"]
