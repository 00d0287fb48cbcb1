"""Incremental Zarr steps: a chunk or shard file equal to the previous step's is hard-linked.

``Checkpointer(..., incremental=True)`` writes each step as a complete Zarr store, through the
usual atomic commit, but with a *base*: the previous committed step. For every write unit (one
shard file, or one chunk file when the array is not sharded) the writer compares what it would
write with the base's file at the same key, first by the CRC-32C words the file holds (a few
bytes read), then byte for byte, then the words of the chunks whose CRC was being computed
meanwhile; when all match it makes a hard link to the base's file in the
new step's temporary directory instead of writing it. Everything else, including every
``zarr.json``, is written as usual.

Why this is safe:

- the base is used only where the array's metadata (shape, data type, chunk grid, codecs, fill
  value: its ``zarr.json`` without attributes, as the Checkpointer's previous save recorded it,
  else as the base's root document's consolidated copy says) is identical, and only for files
  whose bytes are identical, so the new step reads exactly as if it had been written in full
  (the metadata only chooses which files are compared);
- lean_store never writes into an existing file: the direct writer creates each unit file once
  in a fresh temporary directory (exclusively), and so does zarr-python for the arrays it
  writes (each key once; a file equal to the base's is then replaced by a link, by rename), so
  a linked inode is never modified, and no step can change another's data. Tools that rewrite
  a file in place would: zarr-python 3.1.0 itself does when an array of a committed step is
  written again (``mode="r+"``: it truncates the existing chunk file; 3.1.6 writes a temporary
  and renames), so steps must not be edited with it;
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
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import CheckpointError, UnsafeFileError
from ...fork_safe import ForkSafeLock
from ...hardening import MAX_METADATA_BYTES, check_json_depth, root_document_limit
from .chunk_keys import default_chunk_key, key_separator

_CRC_BYTES = 4


@dataclass
class IncrementalStats:
    """What an incremental save wrote and what it linked (file bytes, not tensor bytes)."""

    written_files: int = 0
    written_bytes: int = 0
    linked_files: int = 0
    linked_bytes: int = 0


@dataclass(frozen=True)
class Described:
    """What one committed Zarr save holds: each array's metadata without its attributes, by
    node, as the save wrote it. The next incremental save takes its base's arrays from it
    instead of reading the base's documents again."""

    path: Path
    identity: tuple[int, int]  # (st_dev, st_ino) of the committed directory
    arrays: dict[str, dict[str, Any]]

    def describes(self, path: Path) -> bool:
        """Whether ``path`` is still the directory this save committed."""
        return os.path.abspath(path) == os.path.abspath(self.path) and _identity(path) \
            == self.identity


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


class _Base:
    """The committed step linked to (None: none, the save is only described), how its arrays
    are described, and what the save being written holds."""

    def __init__(self, path: Path | None, stats: IncrementalStats,
                 known: dict[str, dict[str, Any]] | None) -> None:
        self.path = path
        self.stats = stats
        self._known = known  # node -> metadata without attributes, from the base's own save
        self._copies: dict[str, Any] | None = None
        self._read = known is not None
        self.written: dict[str, dict[str, Any]] = {}  # the same, of the save being written
        self._writeback: bool | None = None

    def writeback(self, new_dir: Path) -> bool:
        """Whether written files should start their writeback: not on a file system kept in
        memory (tmpfs), where there is nothing to write back (asked once per save)."""
        if self._writeback is None:
            from ..fs_sync import in_memory

            self._writeback = not in_memory(new_dir.parent)
        return self._writeback

    def described(self, node: str) -> dict[str, Any] | None:
        """``node``'s metadata without attributes in the base: as the save that wrote the
        base recorded it, else as the base's root ``zarr.json`` records it (its consolidated
        copy, read once per save for every array); None when neither has it (then the
        array's own ``zarr.json`` is read)."""
        if self._known is not None:
            return self._known.get(node)
        if not self._read:
            self._read = True
            assert self.path is not None
            self._copies = _consolidated(self.path)
        copy = None if self._copies is None else self._copies.get(node)
        if not isinstance(copy, dict) or copy.get("node_type") != "array":
            return None
        return {k: v for k, v in copy.items() if k != "attributes"}


def _consolidated(root: Path) -> dict[str, Any] | None:
    """The consolidated metadata of the store at ``root`` (node -> document), read through
    no link and within the metadata bounds; None when it has none or it cannot be read."""
    from .checks import read_json_at  # imports zarr: not when lean_store is imported

    try:
        fd = os.open(root, _O_DIR)
    except OSError:
        return None
    try:
        doc = read_json_at(fd, "zarr.json", _root_limit(fd))
    except CheckpointError:
        return None
    finally:
        os.close(fd)
    copies = ((doc.get("consolidated_metadata") or {}) if isinstance(doc, dict) else {})
    members = copies.get("metadata") if isinstance(copies, dict) else None
    return members if isinstance(members, dict) else None


def _root_limit(fd: int) -> int:
    """The most bytes the root document of the store open at ``fd`` may have: the limit of
    a load's walk (:func:`~lean_store.hardening.root_document_limit` of its array documents),
    whose sizes are read only when the root is larger than any one document may be."""
    from .checks import array_document_bytes  # imports zarr: not when lean_store is imported

    try:
        size = os.stat("zarr.json", dir_fd=fd, follow_symlinks=False).st_size
        if size <= MAX_METADATA_BYTES:
            return MAX_METADATA_BYTES
        return root_document_limit(array_document_bytes(fd))
    except OSError:
        return MAX_METADATA_BYTES


_BASE: ContextVar[_Base | None] = ContextVar("lean_store_incremental_base", default=None)
_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) \
    | getattr(os, "O_CLOEXEC", 0)
_O_FILE = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class Linking:
    """An incremental save in progress: its running statistics, and (once it is committed)
    :meth:`described`, for the next save to link to it without reading its documents."""

    def __init__(self, base: _Base) -> None:
        self._base = base
        self.stats = base.stats

    def described(self, path: str | os.PathLike) -> Described | None:
        """The committed save at ``path`` (just written in this context) described, or None
        when its directory cannot be identified."""
        identity = _identity(Path(path))
        if identity is None:
            return None
        return Described(Path(path), identity, dict(self._base.written))


@contextmanager
def linking_from(base: str | os.PathLike | None,
                 described: Described | None = None) -> Iterator[Linking]:
    """Zarr saves in this context (this thread or task) link unit files equal to ``base``'s
    (a committed Zarr store; None: no base, the save is only described) instead of writing
    them. ``described``: a description of an earlier save, used when it is of ``base``."""
    path = None if base is None else Path(base)
    known = described.arrays if described is not None and path is not None \
        and described.describes(path) else None
    state = _Base(path, IncrementalStats(), known)
    token = _BASE.set(state)
    try:
        yield Linking(state)
    finally:
        _BASE.reset(token)


def linker_for(new_array_dir: Path, node: str, metadata: dict[str, Any] | None = None
               ) -> UnitLinker | None:
    """The linker of one array being written at ``new_array_dir``, or None when no base is
    active or the base has no array ``node`` with the same metadata (``metadata``: the new
    array's document when its ``zarr.json`` is not written yet).

    The base's metadata is what the save that wrote it recorded (:class:`Described`), else
    its root document's consolidated copy (one read per save), else the array's own
    ``zarr.json``. Each only narrows which files are compared: a file is linked only when
    its bytes equal the new ones (:meth:`UnitLinker.link_or_write`), so a base altered since
    (its documents, its files) still gives an exact new step."""
    base = _BASE.get()
    if base is None:
        return None
    try:
        if metadata is None:
            new = _metadata(new_array_dir)
        else:
            new = {k: v for k, v in metadata.items() if k != "attributes"}
        if new is None:
            return None
        base.written[node] = new
        if base.path is None:
            return None
        base_dir = base.path / node
        if not stat.S_ISDIR(os.lstat(base_dir).st_mode):  # no link followed
            return None
        old = base.described(node)
        if old is None:
            old = _metadata(base_dir)
    except (OSError, ValueError):
        return None
    if old is None:
        return None
    base_key = None
    if old != new:  # the same array but for the separator of its chunk keys: keys translated
        old_sep, new_sep = key_separator(old), key_separator(new)
        if old_sep is None or new_sep is None \
                or {**old, "chunk_key_encoding": None} != {**new, "chunk_key_encoding": None}:
            return None
        base_key = partial(_translated_key, new_sep, old_sep)
    return UnitLinker(base_dir, new_array_dir, base.stats, base.writeback(new_array_dir),
                      base_key)


def _translated_key(new_sep: str, old_sep: str, key: str) -> str:
    """The key of the chunk file ``key`` (written with ``new_sep``) under ``old_sep``: a base
    written before chunk keys took "." (``c/0/1``) still gives links (``c.0.1``)."""
    head = "c" + new_sep
    if not key.startswith(head):
        return key
    return default_chunk_key(old_sep, key[len(head):].split(new_sep))


def _metadata(array_dir: Path) -> dict[str, Any] | None:
    """The base array's metadata without its attributes; None where it is not a plain array
    document (nested deeper than any, so never parsed: nothing is linked to it)."""
    text = (array_dir / "zarr.json").read_text("utf-8")
    try:
        check_json_depth(text, str(array_dir))
    except UnsafeFileError:
        return None
    meta = json.loads(text)
    if not isinstance(meta, dict) or meta.get("node_type") != "array":
        return None
    meta.pop("attributes", None)
    return meta


_STATS_LOCK = ForkSafeLock()


class UnitLinker:
    """Links one array's unit files to the base's identical files."""

    def __init__(self, base_dir: Path, new_dir: Path, stats: IncrementalStats,
                 writeback: bool = True, base_key: Callable[[str], str] | None = None) -> None:
        """``writeback``: start each written file's writeback at once (not in memory).
        ``base_key``: the base's key of a new unit's key, when the two differ."""
        self._writeback = writeback
        self._base_key = base_key
        self._base_dir = base_dir
        self._new_dir = new_dir
        self.stats = stats

    def _base_path(self, key: str) -> Path:
        """The base's file of the unit whose key (in the new array) is ``key``."""
        return self._base_dir / (key if self._base_key is None else self._base_key(key))

    def link_or_write(self, path: Path, key: str, pieces: list[Any]) -> bytes | None:
        """Create ``path`` (absent) holding ``pieces`` in order: as a hard link to the base's
        file at ``key`` when that holds exactly these bytes, else by writing them. A piece
        may be a callable giving its bytes (a chunk's CRC-32C word, being computed on the CRC
        workers): it is asked for once the other bytes compared equal, and the base's word
        must equal it. A linked file's word at that place is returned (the same value)."""
        base = self._base_path(key)
        same, word = _same_bytes(base, pieces, link_to=path)
        if same:
            with _STATS_LOCK:  # units may be linked on two workers at once
                self.stats.linked_files += 1
                self.stats.linked_bytes += sum(_size(p) for p in pieces)
            return word
        size = 0
        with open(path, "xb") as f:  # never into an existing file (it may be a link)
            for piece in pieces:
                size += f.write(piece() if callable(piece) else piece)
            if self._writeback:
                f.flush()
                _start_writeback(f.fileno())
        with _STATS_LOCK:
            self.stats.written_files += 1
            self.stats.written_bytes += size
        return None

    def link_if_same(self, key: str) -> None:
        """The unit file ``key`` was just written (by zarr, compressed): replace it with a hard
        link to the base's file when the bytes are identical (saves space, not the write)."""
        path = self._new_dir / key
        size = path.stat().st_size
        base = self._base_path(key)
        if size >= _CRC_BYTES:
            data = np.fromfile(path, dtype=np.uint8)
            tmp = path.with_name(f".{path.name}.link")
            if _same_bytes(base, [data[: size - _CRC_BYTES], data[size - _CRC_BYTES:]],
                           link_to=tmp)[0]:
                os.replace(tmp, path)
                with _STATS_LOCK:
                    self.stats.linked_files += 1
                    self.stats.linked_bytes += size
                return
        with _STATS_LOCK:
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


def _libc_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages to disk now, without waiting (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``): the step's written files are usually its
    last tensors, and the commit's ``syncfs`` then waits for less. Durability is still the
    commit's: this only starts it sooner (a no-op in memory file systems and elsewhere)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def _equal_at(address: int, want: np.ndarray) -> bool:
    """The ``want.size`` bytes at ``address`` equal the contiguous uint8 array ``want``
    (memcmp: no temporary)."""
    if _MEMCMP is None:  # pragma: no cover
        return bytes((ctypes.c_char * want.size).from_address(address)) == want.tobytes()
    return _MEMCMP(address, want.ctypes.data, want.size) == 0


def _size(piece: Any) -> int:
    return _CRC_BYTES if callable(piece) else memoryview(piece).nbytes


def _same_bytes(base: Path, pieces: list[Any], link_to: Path | None = None
                ) -> tuple[bool, bytes | None]:
    """(whether the file ``base`` holds ``pieces`` concatenated, what it holds in place of
    a callable piece). A callable piece is a chunk's CRC-32C word being computed on the CRC
    workers while the bytes are compared: it is called last, only when every other byte
    matched, and the file's word must equal it (a base whose data bytes are intact but
    whose stored word is damaged is not linked: the new step would carry the wrong word).
    The CRC-32C words already known (pieces of 4 bytes: each chunk's crc32c, the shard
    index's) are compared first, so a changed unit costs a few small reads; then every byte
    (:func:`_file_holds`). Only a regular file, reached through no link at its own name, can
    hold them. ``link_to``: where to hard-link the file when it holds them, linked through the
    descriptor the bytes were compared through (``/proc/self/fd``), so that a file put at
    ``base`` by another process meanwhile is never the one linked; no link made is no match."""
    try:
        fd = os.open(base, _O_FILE)
    except OSError:  # missing, or a symbolic link
        return False, None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return False, None
        size = info.st_size
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
        if words != [bytes(p()) for p in pieces if callable(p)]:
            return False, None
        if link_to is not None:
            _link_open(fd, base, link_to)
        return True, words[-1] if words else None
    except (OSError, ValueError):
        return False, None
    finally:
        os.close(fd)


def _link_open(fd: int, base: Path, link_to: Path) -> None:
    """Hard-link the open file ``fd`` (opened at ``base``) at ``link_to``: through
    ``/proc/self/fd`` where there is one (``linkat`` with ``AT_SYMLINK_FOLLOW`` on that link
    links the very file open; a failure is an ``OSError``, and the caller writes the file),
    else by ``base``'s name."""
    if _ROOT_FD is None:
        os.link(base, link_to)
        return
    # a dir fd makes os.link call linkat (with follow_symlinks: AT_SYMLINK_FOLLOW); the
    # source path is absolute, so which directory it is does not matter
    os.link(f"/proc/self/fd/{fd}", link_to, src_dir_fd=_ROOT_FD, follow_symlinks=True)


def _root_fd() -> int | None:
    if not os.path.isdir("/proc/self/fd") or os.link not in os.supports_dir_fd:
        return None
    try:
        return os.open("/", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                       | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # pragma: no cover
        return None


_ROOT_FD = _root_fd()
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


__all__ = ["Described", "IncrementalStats", "Linking", "UnitLinker", "linker_for",
           "linking_from"]
