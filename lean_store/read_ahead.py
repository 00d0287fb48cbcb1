"""Reading the tensors of one load on two threads: the caller's and one read-ahead worker.

A compressed load is CPU-bound (Blosc decompression and CRC-32C passes, docs/PERFORMANCE.md),
and a load reads its tensors one at a time, each of one chunk or a few: a tensor's
decompression cannot overlap the ``pread`` and CRC-32C of its own next chunk when it has none.
Here two threads share the tensors, so that one thread reads, checks and decompresses a
tensor while the other does another one (numcodecs releases the GIL while Blosc runs; Blosc
uses its own threads only on the main thread, its one-thread context elsewhere): the worker
takes the big tensors first, the caller the small ones, and each then helps with the other's.

Each tensor is read whole by one thread with the caller's ``read`` (for a load,
:meth:`lean_store.Checkpoint.read_bits`: every chunk and the digest checked). Nothing is
returned until every tensor is read: the first error is raised only after the worker has
stopped, so that no read is still running on the checkpoint when the caller closes it, and a
failed load returns nothing at all. The memory held is the results themselves (a load keeps
them anyway) and each thread's scratch for one chunk.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .shared_threads import SharedThreads

T = TypeVar("T")

READ_AHEAD_MIN_BYTES = 1 << 20
"""Loads of fewer bytes read on the calling thread alone: a hand-off costs more than it wins."""

SMALL_BYTES = 64 << 10
"""Tensors the caller reads first. A small tensor's read is a few short system calls and
Python around them; each call gives up the GIL, and two threads doing that at once wait on
each other for it. The worker's big reads hold the GIL little (a long ``preadv``, CRC-32C,
decompression)."""

_READ_AHEAD = SharedThreads(1, "lean_store-read-ahead")


def read_ahead_worker() -> ThreadPoolExecutor:
    """The one read-ahead thread the process's loads share (started at first use). Not one
    of :func:`lean_store.integrity.crc_workers`: a read may itself wait on those."""
    return _READ_AHEAD.get()


def read_all(names: Sequence[str], read: Callable[[str], T], *, sizes: Sequence[int]
             ) -> dict[str, T]:
    """``{name: read(name)}`` for every name (in ``names``' order; ``sizes``: their bytes),
    read on the calling thread and the read-ahead worker together when there are several
    names of :data:`READ_AHEAD_MIN_BYTES` at least in all. The worker starts with the big
    tensors, the caller with the small ones (below :data:`SMALL_BYTES`); each takes from the
    other's list once its own is done. The first error raised by either thread is raised
    once both have stopped; nothing is returned then."""
    if len(names) < 2 or sum(sizes) < READ_AHEAD_MIN_BYTES:
        return {name: read(name) for name in names}
    results: dict[str, T] = {}
    small = iter([n for n, size in zip(names, sizes) if size < SMALL_BYTES])
    big = iter([n for n, size in zip(names, sizes) if size >= SMALL_BYTES])
    lock = threading.Lock()
    failed = threading.Event()

    def work(first: Iterator[str], then: Iterator[str]) -> None:
        while not failed.is_set():
            with lock:
                name = next(first, None)
                if name is None:
                    name = next(then, None)
            if name is None:
                return
            try:
                results[name] = read(name)
            except BaseException:
                failed.set()  # the other thread takes no further tensor
                raise

    worker = read_ahead_worker().submit(work, big, small)
    try:
        work(small, big)
    finally:
        error = worker.exception()  # waits: no read of the worker outlives this call
    if error is not None:
        raise error
    return {name: results[name] for name in names}


__all__ = ["READ_AHEAD_MIN_BYTES", "SMALL_BYTES", "read_ahead_worker", "read_all"]
