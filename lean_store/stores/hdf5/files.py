"""h5py files of lean_store, opened through HDF5's POSIX driver whatever the environment says.

libhdf5 takes its default file driver from ``HDF5_DRIVER``: with ``split``, ``multi`` or
``family`` there, a file h5py opens by path is several files on disk (``NAME.meta`` and
``NAME.raw``, ...), so a save left those temporaries behind and failed with a misleading
"no such file", and a load failed to find the checkpoint's one file. A checkpoint is one file,
so lean_store names the driver (``sec2``, HDF5's default, the one the header path's ``pread``
reads through); sources that are not paths (file objects) keep h5py's choice. Whether a file
is HDF5 at all is read from its signature (:func:`.checks.hdf5_superblock_offset`), not asked
of libhdf5, which would open it with that driver too.

A process forked while lean_store writes an HDF5 file holds libhdf5's copy of that open file.
When such a child exits normally, libhdf5's exit handler flushes and closes the files it has
open: it wrote the child's stale metadata into the parent's file and truncated it to the
child's end of file, so the parent committed a corrupt checkpoint. Files being written are
therefore opened and closed here (:func:`open_for_writing`, :func:`close_written`), recorded
while open, and in a forked child HDF5's descriptor of
each is pointed at a throwaway file (``dup2``) before the child runs on: whatever libhdf5 does
with it there reaches neither the parent's file nor its checkpoint.
"""

from __future__ import annotations

import errno
import itertools
import os
import tempfile
from typing import Any

import h5py

from ...errors import CheckpointBusyError
from ...fork_safe import ForkSafeLock

DRIVER = "sec2"


def open_file(source: Any, mode: str, **kwargs: Any) -> h5py.File:
    """``h5py.File(source, mode, **kwargs)``, with ``driver="sec2"`` when ``source`` is a path.

    HDF5 locks the file it opens (``flock``). A file another process holds open for writing
    (that lock taken there): :class:`CheckpointBusyError`. A file system without locks (NFS
    mounted ``nolock``: "No locks available"): opened again without HDF5's lock, since no
    process can hold one there either."""
    if isinstance(source, (str, bytes, os.PathLike)):
        kwargs["driver"] = DRIVER
    try:
        return h5py.File(source, mode, **kwargs)
    except OSError as exc:
        if not _lock_failure(exc):
            raise
        if exc.errno in _NO_LOCKS and LOCKING_OPTION and "locking" not in kwargs:
            return h5py.File(source, mode, locking=False, **kwargs)
        if is_lock_conflict(exc):
            raise CheckpointBusyError(os.fsdecode(source) if isinstance(
                source, (str, bytes, os.PathLike)) else source, str(exc)) from None
        raise


_CONFLICT_ERRNOS = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES)
_NO_LOCKS = frozenset((errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP,
                       524))  # 524: Linux's ENOTSUPP, which NFS returns
LOCKING_OPTION = h5py.version.hdf5_version_tuple >= (1, 12, 1) or (
    (1, 10, 7) <= h5py.version.hdf5_version_tuple < (1, 11))
"""h5py's ``locking`` option needs HDF5 1.12.1+ or 1.10.7+ (h5py's wheels bundle 1.14+)."""


def _lock_failure(exc: OSError) -> bool:
    return "unable to lock file" in str(exc)


def is_lock_conflict(exc: OSError) -> bool:
    """True when h5py's ``exc`` says HDF5 could not take its lock on the file because another
    process holds it: open for writing (or, opening to write, for reading). HDF5 (1.10.7 to
    2.0) says "unable to lock file" with the ``flock`` errno."""
    return _lock_failure(exc) and exc.errno in (*_CONFLICT_ERRNOS, None)


_WRITING: dict[int, int] = {}  # token -> HDF5's descriptor of a file lean_store is writing
_WRITING_LOCK = ForkSafeLock()
_TOKENS = itertools.count()


def open_for_writing(path: str | os.PathLike[str], mode: str = "w", **kwargs: Any
                     ) -> tuple[h5py.File, int | None]:
    """``open_file(path, mode, **kwargs)`` (a writing mode) and its token for
    :func:`close_written`. No fork happens between the two (the before-fork hook waits for
    them): a child never holds the file unrecorded. Without HDF5's file lock: lean_store
    writes only its own temporaries, which no other process opens, and a lock there guards
    nothing but fails every save on a file system without locks."""
    if LOCKING_OPTION:
        kwargs.setdefault("locking", False)
    with _WRITING_LOCK:
        file = open_file(path, mode, **kwargs)
        try:
            fd = file.id.get_vfd_handle()
        except (OSError, RuntimeError, ValueError, TypeError):
            fd = None
        if not isinstance(fd, int):
            return file, None
        token = next(_TOKENS)
        _WRITING[token] = fd
        return file, token


def close_written(file: h5py.File, token: int | None) -> None:
    """Close ``file`` (of :func:`open_for_writing`) and forget it, with no fork in between (a
    child would otherwise redirect the closed descriptor's number, reused meanwhile)."""
    with _WRITING_LOCK:
        try:
            file.close()
        finally:
            if token is not None:
                _WRITING.pop(token, None)


def _throwaway() -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create("lean_store-forked-hdf5", getattr(os, "MFD_CLOEXEC", 0))
    fd, name = tempfile.mkstemp(prefix=".lean_store-forked-")
    os.unlink(name)
    return fd


def _detach_in_child() -> None:
    descriptors = list(_WRITING.values())
    _WRITING.clear()
    for fd in descriptors:
        try:
            spare = _throwaway()
            try:
                os.dup2(spare, fd)
            finally:
                os.close(spare)
        except OSError:  # nothing to redirect: the file is not there either
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_WRITING_LOCK.acquire, after_in_parent=_WRITING_LOCK.release,
                        after_in_child=_detach_in_child)


__all__ = ["DRIVER", "close_written", "open_file", "open_for_writing"]
