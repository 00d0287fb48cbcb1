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
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_COMPARE_BLOCK = 1 << 22  # bytes compared per read
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

    def link_or_write(self, path: Path, key: str, pieces: list[Any]) -> None:
        """Create ``path`` (absent) holding ``pieces`` in order: as a hard link to the base's
        file at ``key`` when that holds exactly these bytes, else by writing them."""
        views = [memoryview(p).cast("B") for p in pieces]
        size = sum(v.nbytes for v in views)
        base = self._base_file(key)
        if base is not None and _same_bytes(base, views, size):
            os.link(base, path)
            self.stats.linked_files += 1
            self.stats.linked_bytes += size
            return
        with open(path, "xb") as f:  # never into an existing file (it may be a link)
            for view in views:
                f.write(view)
        self.stats.written_files += 1
        self.stats.written_bytes += size

    def link_if_same(self, key: str) -> None:
        """The unit file ``key`` was just written (by zarr, compressed): replace it with a hard
        link to the base's file when the bytes are identical (saves space, not the write)."""
        path = self._new_dir / key
        size = path.stat().st_size
        base = self._base_file(key)
        if base is not None and size >= _CRC_BYTES:
            data = np.fromfile(path, dtype=np.uint8)
            views = [data[: size - _CRC_BYTES].data, data[size - _CRC_BYTES:].data]
            if _same_bytes(base, views, size):
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


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Two contiguous uint8 arrays of one size hold the same bytes (memcmp: no temporary)."""
    if _MEMCMP is None:  # pragma: no cover
        return bool(np.array_equal(a, b))
    return _MEMCMP(a.ctypes.data, b.ctypes.data, a.size) == 0


def _same_bytes(base: Path, views: list[memoryview], size: int) -> bool:
    """True when the file ``base`` holds exactly ``views`` concatenated. The CRC-32C words
    (pieces of 4 bytes: each chunk's crc32c, the shard index's) are compared first, so a
    changed unit costs a few small reads; then every byte."""
    try:
        fd = os.open(base, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size != size:
            return False
        offsets, at = [], 0
        for view in views:
            offsets.append(at)
            at += view.nbytes
        small = [(o, v) for o, v in zip(offsets, views) if v.nbytes == _CRC_BYTES]
        for offset, view in small:
            if os.pread(fd, _CRC_BYTES, offset) != view.tobytes():
                return False
        buf = np.empty(min(_COMPARE_BLOCK, size) or 1, np.uint8)
        for offset, view in zip(offsets, views):
            if view.nbytes == _CRC_BYTES:
                continue
            want = np.frombuffer(view, np.uint8)
            for start in range(0, want.size, buf.size):
                part = want[start: start + buf.size]
                got = os.preadv(fd, [buf[: part.size]], offset + start)  # type: ignore[list-item]  # numpy stubs: __buffer__ 3.12+
                if got != part.size or not _equal(buf[: part.size], part):
                    return False
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


__all__ = ["IncrementalStats", "UnitLinker", "linker_for", "linking_from"]
