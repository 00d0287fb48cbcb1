"""Chunks compressed on a thread pool and handed on in the order they were submitted.

Both backends compress chunks this way (HDF5 Blosc and deflate, Zarr Blosc): the codecs release
the GIL, so chunks compress on the pool while the caller's thread writes the ones before them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

MAX_PENDING = 4
"""Chunks compressed ahead of their writes (bounds the extra memory)."""


class OrderedPool:
    """``encode(chunk, ...)`` on ``pool``; each result handed to its ``put`` once it and every
    earlier one are ready, on the caller's thread. At most :data:`MAX_PENDING` in flight; the
    rest when :meth:`flush` is called."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self._pending: deque[tuple[Future, Callable[[Any], object]]] = deque()

    def busy(self) -> bool:
        """Whether chunks are in flight (then a small one queues too, to keep the order)."""
        return bool(self._pending)

    def submit(self, put: Callable[[Any], object], encode: Callable[..., Any], chunk: np.ndarray,
               *args: Any) -> None:
        """``encode(chunk, *args)`` on the pool (``chunk``: a copy the caller no longer
        touches); ``put`` the result once it and every earlier chunk's are ready."""
        self._pending.append((self.pool.submit(encode, chunk, *args), put))
        while self._pending and (len(self._pending) > MAX_PENDING or self._pending[0][0].done()):
            self._put_oldest()

    def _put_oldest(self) -> None:
        future, put = self._pending.popleft()
        put(future.result())

    def flush(self) -> None:
        """Hand on every chunk still queued."""
        while self._pending:
            self._put_oldest()

    def cancel(self) -> None:
        for future, _put in self._pending:
            future.cancel()
        self._pending.clear()

    def finish(self, *, flush: bool) -> None:
        """The end of a save: hand on every queued chunk (``flush``; a failed or aborted save
        does not), and in any case cancel what is left and stop the pool's threads."""
        try:
            if flush:
                self.flush()
        finally:
            self.cancel()
            self.pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["MAX_PENDING", "OrderedPool"]
