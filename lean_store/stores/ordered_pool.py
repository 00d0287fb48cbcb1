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
"""Chunks compressed ahead of their writes, whatever their size (bounds the extra memory)."""
MAX_PENDING_BYTES = 16 << 20
"""More chunks may be in flight while their bytes stay within this: a model's small tensors
(biases, norms) between two big chunks then do not hold the second back until the first is
written, which left one of the pool's two threads idle."""
MAX_PENDING_CHUNKS = 256
"""The most chunks in flight however small (bounds the queue itself)."""


class OrderedPool:
    """``encode(chunk, ...)`` on ``pool``; each result handed to its ``put`` once it and every
    earlier one are ready, on the caller's thread. In flight: :data:`MAX_PENDING` chunks, or
    more while their bytes stay within :data:`MAX_PENDING_BYTES` (at most
    :data:`MAX_PENDING_CHUNKS`); the rest when :meth:`flush` is called."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self._pending: deque[tuple[Future, Callable[[Any], object], int]] = deque()
        self._pending_bytes = 0

    def busy(self) -> bool:
        """Whether chunks are in flight (then a small one queues too, to keep the order)."""
        return bool(self._pending)

    def submit(self, put: Callable[[Any], object], encode: Callable[..., Any], chunk: np.ndarray,
               *args: Any) -> None:
        """``encode(chunk, *args)`` on the pool (``chunk``: a copy the caller no longer
        touches); ``put`` the result once it and every earlier chunk's are ready."""
        self._pending.append((self.pool.submit(encode, chunk, *args), put, chunk.nbytes))
        self._pending_bytes += chunk.nbytes
        while self._pending and (self._full() or self._pending[0][0].done()):
            self._put_oldest()

    def _full(self) -> bool:
        count = len(self._pending)
        return count > MAX_PENDING_CHUNKS or (
            count > MAX_PENDING and self._pending_bytes > MAX_PENDING_BYTES)

    def _put_oldest(self) -> None:
        future, put, nbytes = self._pending.popleft()
        self._pending_bytes -= nbytes
        put(future.result())

    def flush(self) -> None:
        """Hand on every chunk still queued."""
        while self._pending:
            self._put_oldest()

    def cancel(self) -> None:
        for future, _put, _nbytes in self._pending:
            future.cancel()
        self._pending.clear()
        self._pending_bytes = 0

    def finish(self, *, flush: bool) -> None:
        """The end of a save: hand on every queued chunk (``flush``; a failed or aborted save
        does not), and in any case cancel what is left and stop the pool's threads."""
        try:
            if flush:
                self.flush()
        finally:
            self.cancel()
            self.pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["MAX_PENDING", "MAX_PENDING_BYTES", "MAX_PENDING_CHUNKS", "OrderedPool"]
