"""Locks that a forked child gets unlocked.

``fork`` copies a process with only the thread that called it. A lock one of the parent's other
threads held at that moment (a background save, a load's read-ahead worker) stays locked in the
child, where no thread will ever release it: the child's next save or load through that lock
hangs. Torch's DataLoader workers and ``multiprocessing`` pools are such children. Every lock
lean_store shares between its threads is a :class:`ForkSafeLock`, replaced by a new one in each
child (``os.register_at_fork``; without it, as on Windows, there is no fork).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any


class ForkSafeLock:
    """A ``threading.Lock`` (``acquire``, ``release``, ``with``) renewed in a forked child."""

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _LOCKS.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()


_LOCKS: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _renew_in_child() -> None:
    for lock in list(_LOCKS):
        lock._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_in_child)


__all__ = ["ForkSafeLock"]
