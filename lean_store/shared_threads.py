"""Thread pools a process starts once and every save and load shares."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor


class SharedThreads:
    """``workers`` threads named ``prefix``, started at first use (a thread start waits for
    the new thread to be scheduled: milliseconds on a busy machine) and shared by the whole
    process; a forked child starts its own afresh (the parent's threads do not exist there)."""

    def __init__(self, workers: int, prefix: str) -> None:
        self._workers = workers
        self._prefix = prefix
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self.forget)

    def get(self) -> ThreadPoolExecutor:
        """The pool, started if it is not yet."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix=self._prefix)
            return self._pool

    def forget(self) -> None:
        """Start afresh at the next :meth:`get` (in a forked child)."""
        self._pool, self._lock = None, threading.Lock()
