"""The file a save replaces, released on a background thread instead of by the save.

A save to a path that holds a checkpoint file renames its new file over the old one. The
rename drops the old file's last name, and the kernel frees its blocks (tmpfs: its pages) in
that call: ~30 ms for 216 MB on tmpfs, on the thread that saves, after the save's own work is
done. Held open across the rename (:func:`hold`), the old file keeps its blocks until that
descriptor is closed; :func:`release_later` closes it on a background thread, where the
freeing overlaps whatever the caller does next.

Nothing of the old file stays visible: on a local file system it has no name after the rename
(elsewhere, NFS for one, it is not held: the client would show it as ``.nfs*`` until closed),
and a process that dies with the descriptor open has it closed by the kernel. A local save
waits for the old files still held before it writes anything
(:class:`~lean_store.stores.commit.LocalCommit`), so that it never needs more room than
when the rename freed them; the freeing overlaps what the caller does between saves. At most
:data:`MAX_HELD` old files are held at once (a save waits for the oldest beyond that), so
saves that come faster than the freeing cannot keep many old checkpoints' space; the
interpreter's exit waits for the closes still queued (``concurrent.futures`` joins its
threads).
"""

from __future__ import annotations

import os
import stat
from collections import deque
from concurrent.futures import Future
from pathlib import Path

from ..fork_safe import ForkSafeLock
from ..shared_threads import SharedThreads
from . import fs_sync

MAX_HELD = 2
"""Old files held open, waiting to be released, at most."""

_RELEASER = SharedThreads(1, "lean_store-release")
_PENDING: deque[Future[None]] = deque()
_LOCK = ForkSafeLock()  # the queue (held while waiting for its oldest)
_HELD: dict[int, tuple[int, int]] = {}  # descriptor -> (device, inode) of the file it holds
_HELD_LOCK = ForkSafeLock()  # _HELD (taken by the background close: never waits)
_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(
    os, "O_NONBLOCK", 0)


def hold(target: Path) -> int | None:
    """A descriptor of the regular file at ``target`` (not followed through a link), which
    keeps its blocks past a rename over it; None where there is none, or where the file
    system is not one known to keep such a file nameless
    (:func:`~lean_store.stores.fs_sync.open_files_stay_nameless`: an NFS client would show
    it as ``.nfs*`` until it is closed; Windows cannot rename over an open file)."""
    if os.name != "posix" or not fs_sync.open_files_stay_nameless(target.parent):
        return None
    try:
        fd = os.open(target, _FLAGS)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
    except OSError:
        info = None
    if info is None or not stat.S_ISREG(info.st_mode):
        os.close(fd)
        return None
    with _HELD_LOCK:
        _HELD[fd] = (info.st_dev, info.st_ino)
    return fd


def release_later(fd: int | None) -> None:
    """Close ``fd`` (from :func:`hold`) on the background thread; with :data:`MAX_HELD`
    closes queued already, wait for the oldest first."""
    if fd is None:
        return
    with _LOCK:
        while len(_PENDING) >= MAX_HELD:
            _PENDING.popleft().exception()  # waits; an old file's close error is no save's
        try:
            _PENDING.append(_RELEASER.get().submit(_close, fd))
            return
        except RuntimeError:  # the interpreter is shutting down: no new thread
            pass
    _close(fd)


def release_now(fd: int | None) -> None:
    """Close ``fd`` (from :func:`hold`) here: the rename it was held for did not happen."""
    if fd is not None:
        _close(fd)


def _close(fd: int) -> None:
    with _HELD_LOCK:
        identity = _HELD.get(fd)
    try:
        os.close(fd)
    finally:  # forgotten only once closed (a child forked in between checks it, _forget),
        with _HELD_LOCK:  # and only if the number was not held again since
            if _HELD.get(fd) == identity:
                _HELD.pop(fd, None)


def wait_released() -> None:
    """Wait until every old file queued by :func:`release_later` is closed."""
    with _LOCK:
        while _PENDING:
            _PENDING.popleft().exception()  # waits (a close that failed has nothing to redo)


def _forget() -> None:
    """In a forked child: its copies of the descriptors held are closed (else the child
    would keep the old files' space while it lives), and the parent's queue is not its own
    (the locks are :class:`~lean_store.fork_safe.ForkSafeLock`s, renewed in the child). A
    descriptor is closed only if it still holds the file it held (the parent may have closed
    it, and reused its number, as the fork happened)."""
    global _PENDING, _HELD
    held, _HELD = _HELD, {}
    _PENDING = deque()
    for fd, identity in held.items():
        try:
            info = os.fstat(fd)
            if (info.st_dev, info.st_ino) == identity:
                os.close(fd)
        except OSError:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


__all__ = ["MAX_HELD", "hold", "release_later", "release_now", "wait_released"]
