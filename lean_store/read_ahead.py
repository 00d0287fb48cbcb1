"""Reading the tensors of one load on two threads: the caller's and one read-ahead worker.

A compressed load is CPU-bound (Blosc decompression and CRC-32C passes, docs/PERFORMANCE.md),
and a load reads its tensors one at a time, each of one chunk or a few: a tensor's
decompression cannot overlap the ``pread`` and CRC-32C of its own next chunk when it has none.
Here two threads take the tensors in turn from one queue, so that one thread reads, checks and
decompresses a tensor while the other does the next one (numcodecs releases the GIL while Blosc
runs; Blosc uses its own threads only on the main thread, its one-thread context elsewhere).

Each tensor is read whole by one thread with the caller's ``read`` (for a load,
:meth:`lean_store.Checkpoint.read_bits`: every chunk and the digest checked). Nothing is
returned until every tensor is read: the first error is raised only after the worker has
stopped, so that no read is still running on the checkpoint when the caller closes it, and a
failed load returns nothing at all. The memory held is the results themselves (a load keeps
them anyway) and each thread's scratch for one chunk.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .shared_threads import SharedThreads

T = TypeVar("T")

READ_AHEAD_MIN_BYTES = 1 << 20
"""Loads of fewer bytes read on the calling thread alone: a hand-off costs more than it wins."""

_READ_AHEAD = SharedThreads(1, "lean_store-read-ahead")


def read_ahead_worker() -> ThreadPoolExecutor:
    """The one read-ahead thread the process's loads share (started at first use). Not one
    of :func:`lean_store.integrity.crc_workers`: a read may itself wait on those."""
    return _READ_AHEAD.get()


def read_all(names: Sequence[str], read: Callable[[str], T], *, total_bytes: int
             ) -> dict[str, T]:
    """``{name: read(name)}`` for every name (in ``names``' order), read on the calling thread
    and the read-ahead worker together when there are several names and ``total_bytes`` of
    them at least :data:`READ_AHEAD_MIN_BYTES`. The first error raised by either thread is
    raised once both have stopped; nothing is returned then."""
    if len(names) < 2 or total_bytes < READ_AHEAD_MIN_BYTES:
        return {name: read(name) for name in names}
    results: dict[str, T] = {}
    queue = iter(names)
    lock = threading.Lock()
    failed = threading.Event()

    def work() -> None:
        while not failed.is_set():
            with lock:
                name = next(queue, None)
            if name is None:
                return
            try:
                results[name] = read(name)
            except BaseException:
                failed.set()  # the other thread takes no further tensor
                raise

    worker = read_ahead_worker().submit(work)
    try:
        work()
    finally:
        error = worker.exception()  # waits: no read of the worker outlives this call
    if error is not None:
        raise error
    return {name: results[name] for name in names}


__all__ = ["READ_AHEAD_MIN_BYTES", "read_ahead_worker", "read_all"]
