"""Small chunks of an HDF5 save, written behind in batches by the save's workers.

Linux lets one thread at a time write into a file (the inode's lock, on tmpfs as on ext4). A
save's workers write its large chunks at their allocated offsets while the thread that runs
libhdf5 creates the next datasets; when that thread wrote the small chunks itself (a norm's
1 KiB vector), each such write waited for the worker's large one to end (~1 ms for 2-4 MiB),
and the large writes stopped overlapping the work on metadata. Here the small chunks of a
stable source (memory that stays unchanged for the save) are queued, their CRC-32C computed
by the caller, and written by a worker in batches of about :data:`BATCH_BYTES`.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

import numpy as np

BATCH_BYTES = 1 << 20
"""Bytes of small chunks handed to a worker at once."""
MAX_BATCHES = 8
"""Batches handed off and not yet written, at most: the caller waits for the oldest before it
hands off one more, so that chunks copied from a non-contiguous source (``bits`` that are not
views of the tensor's memory) stay within ~8 MiB when the disk is slower than the save."""


def pwrite_all(fd: int, pieces: list[Any], offset: int) -> None:
    """``pieces`` written one after another from ``offset`` with ``pwritev`` (resumed after
    a short write; at most 1024 buffers a call, IOV_MAX on Linux)."""
    views = [memoryview(p).cast("B") for p in pieces if p.nbytes]
    while views:
        done = os.pwritev(fd, views[:1024], offset)
        if done <= 0:
            raise OSError(f"pwritev wrote nothing at offset {offset}")
        offset += done
        while views and done >= views[0].nbytes:
            done -= views[0].nbytes
            views.pop(0)
        if done:
            views[0] = views[0][done:]


def write_padded(fd: int, offset: int, data: np.ndarray, pad: int) -> None:
    """``data`` written at ``offset``, then ``pad`` zero bytes (an edge chunk, as
    ``H5Dwrite_chunk`` would store it)."""
    pwrite_all(fd, [data, np.zeros(pad, np.uint8)] if pad else [data], offset)


def _write_batch(fd: int, items: list[tuple[int, np.ndarray, int]]) -> int:
    """Each ``(offset, bytes, padding)`` of ``items`` written (:func:`write_padded`)."""
    for offset, data, pad in items:
        write_padded(fd, offset, data, pad)
    return len(items)


class SmallChunkWrites:
    """The small chunks of one file, queued and written in batches on a worker."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._items: list[tuple[int, np.ndarray, int]] = []
        self._bytes = 0
        self._pending: list[Future[int]] = []
        self._submit: Any = None

    def add(self, offset: int, data: np.ndarray, pad: int, submit: Any) -> None:
        """Queue ``data`` (+ ``pad`` zero bytes) for ``offset``; ``submit(fn, *args)`` runs
        ``fn`` on a worker and returns its future (see ``TensorWriter.write_later``)."""
        self._submit = submit
        self._items.append((offset, data, pad))
        self._bytes += data.nbytes + pad
        if self._bytes >= BATCH_BYTES:
            self._hand_off()

    def _hand_off(self) -> None:
        if not self._items:
            return
        items, self._items, self._bytes = self._items, [], 0
        self._pending = [f for f in self._pending if not f.done() or f.exception()]
        while len(self._pending) >= MAX_BATCHES:
            self._pending.pop(0).result()  # an error is raised here, as at finish()
        self._pending.append(self._submit(_write_batch, self._fd, items))

    def finish(self) -> None:
        """Every queued chunk written; the first error of a batch raised."""
        self._hand_off()
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def abandon(self) -> None:
        """After an error: no batch still writing (their own errors dropped)."""
        self._items, self._bytes = [], 0
        pending, self._pending = self._pending, []
        for future in pending:
            try:
                future.result()
            except BaseException:  # noqa: BLE001, S110 - the first error is propagating
                pass
