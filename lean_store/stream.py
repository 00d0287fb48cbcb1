"""Staging device tensors through a small pool of reusable host buffers, in write order.

The save pipeline walks the state one write unit (a chunk, or a zarr shard) at a time. CPU
tensors need no staging: their bits are zero-copy views handed straight to the store. A tensor
on an accelerator has a :class:`CopyEngine` (see ``sources/torch_source.py``): the pipeline
asks it to start an asynchronous copy of the next units into free host buffers (pinned memory,
a side stream, an event per copy) while the store writes the current one, so device-to-host
copies overlap the writes. The buffers come from a :class:`BufferPool` bounded by
``buffer_bytes``: peak extra host memory is a few write units, never proportional to the model.

The engine is an interface so the ordering and memory logic is tested on a CPU with a fake
device (``tests/core/test_streaming.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from .chunking import Region
from .errors import CheckpointError

DEFAULT_BUFFER_BYTES = 64 << 20
"""Default staging budget: with 4 MiB chunks, up to 4 units in flight (16 MiB each at most)."""
MAX_BUFFERS = 4
"""Host buffers per pool: one being written, the rest filling from the device."""

K = TypeVar("K")


class CopyEngine(ABC):
    """Copies regions of one kind of device tensor into host buffers, asynchronously."""

    @abstractmethod
    def allocate(self, nbytes: int) -> Any:
        """A new host buffer of ``nbytes`` bytes (pinned where the device benefits)."""

    def free(self, buffer: Any) -> None:  # noqa: B027 - optional hook
        """Release a buffer the pool no longer needs (default: let it be collected)."""

    @abstractmethod
    def nbytes(self, tensor: Any, region: Region) -> int:
        """Bytes of ``region`` of ``tensor`` once on the host."""

    @abstractmethod
    def start(self, tensor: Any, region: Region, buffer: Any) -> Callable[[], np.ndarray]:
        """Enqueue the copy of ``region`` into ``buffer``; return a function that waits for
        it and gives the raw words as a numpy view of the buffer."""


class PooledBuffer:
    """One reusable host buffer of the pool."""

    __slots__ = ("raw", "capacity")

    def __init__(self, raw: Any, capacity: int) -> None:
        self.raw = raw
        self.capacity = capacity


class BufferPool:
    """Reusable host buffers with a byte budget.

    Buffers are allocated up to ``max_buffers`` and ``budget_bytes`` in total, each at least
    ``budget_bytes // max_buffers`` so equal-sized units reuse them. A request that does not fit
    waits (``try_acquire`` returns None) while another buffer is in use; when none is, it is
    always granted, so a single write unit larger than the budget still proceeds (the bound is
    then one unit).
    """

    def __init__(
        self,
        allocate: Callable[[int], Any],
        free: Callable[[Any], None] | None = None,
        *,
        budget_bytes: int = DEFAULT_BUFFER_BYTES,
        max_buffers: int = MAX_BUFFERS,
    ) -> None:
        if budget_bytes < 1 or max_buffers < 1:
            raise CheckpointError("buffer_bytes and max_buffers must be positive")
        self._allocate = allocate
        self._free_fn = free or (lambda raw: None)
        self.budget_bytes = int(budget_bytes)
        self.max_buffers = int(max_buffers)
        self._free: list[PooledBuffer] = []
        self.in_use = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_buffers = 0
        self.allocations = 0

    @property
    def live_buffers(self) -> int:
        return self.in_use + len(self._free)

    def try_acquire(self, nbytes: int) -> PooledBuffer | None:
        fits = [b for b in self._free if b.capacity >= nbytes]
        if fits:
            best = min(fits, key=lambda b: b.capacity)
            self._free.remove(best)
            self.in_use += 1
            return best
        capacity = max(int(nbytes), self.budget_bytes // self.max_buffers, 1)
        # make room: drop free buffers that are too small while the new one would not fit
        while self._free and (
            self.live_buffers >= self.max_buffers or self.live_bytes + capacity > self.budget_bytes
        ):
            self._drop(min(self._free, key=lambda b: b.capacity))
        if self.in_use and (
            self.live_buffers >= self.max_buffers or self.live_bytes + capacity > self.budget_bytes
        ):
            return None
        buffer = PooledBuffer(self._allocate(capacity), capacity)
        self.allocations += 1
        self.live_bytes += capacity
        self.in_use += 1
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.peak_buffers = max(self.peak_buffers, self.live_buffers)
        return buffer

    def release(self, buffer: PooledBuffer) -> None:
        self.in_use -= 1
        self._free.append(buffer)

    def _drop(self, buffer: PooledBuffer) -> None:
        self._free.remove(buffer)
        self.live_bytes -= buffer.capacity
        self._free_fn(buffer.raw)

    def close(self) -> None:
        """Free every idle buffer."""
        while self._free:
            self._drop(self._free[-1])


@dataclass
class _Pending(Generic[K]):
    key: K
    tensor: Any
    region: Region | None
    wait: Callable[[], np.ndarray] | None = None
    buffer: PooledBuffer | None = None
    pool: BufferPool | None = None


def staged(
    items: Iterable[tuple[K, Any, Region | None]],
    *,
    buffer_bytes: int | None = None,
    max_buffers: int = MAX_BUFFERS,
    pools: dict[Hashable, BufferPool] | None = None,
) -> Iterator[tuple[K, Region | None, np.ndarray | None]]:
    """Raw words of each ``(key, tensor, region)`` item, in order, as ``(key, region, bits)``.

    ``tensor`` is a source tensor (``.read(region)``, and a ``stage_engine`` attribute that is
    a :class:`CopyEngine` for device tensors, None for host ones) or None for a marker item,
    passed through as ``(key, None, None)``. Host tensors are read when their turn comes.
    Device regions are copied ahead into pooled host buffers: while the caller handles unit
    ``i``, the copies of the next units are already running. A yielded array is valid until
    the caller asks for the next item; its buffer is reused after that.
    """
    budget = DEFAULT_BUFFER_BYTES if buffer_bytes is None else int(buffer_bytes)
    pools = {} if pools is None else pools
    lookahead = 2 * max_buffers + 2
    queue: deque[_Pending[K]] = deque()
    source = iter(items)
    held: tuple[K, Any, Region | None] | None = None
    exhausted = False
    try:
        while True:
            while not exhausted and len(queue) < lookahead:
                item = held if held is not None else next(source, None)
                held = None
                if item is None:
                    exhausted = True
                    break
                key, tensor, region = item
                engine = getattr(tensor, "stage_engine", None) if tensor is not None else None
                if engine is None or region is None:
                    if not queue and not pools:
                        # its turn is now and no device copy can run ahead of it (none met
                        # yet; all-host sources never meet one): no bookkeeping
                        yield key, region, (None if tensor is None or region is None
                                            else tensor.read(region))
                        continue
                    queue.append(_Pending(key, tensor, region))
                    continue
                pool = pools.get(id(engine))
                if pool is None:
                    pool = pools[id(engine)] = BufferPool(
                        engine.allocate, engine.free, budget_bytes=budget, max_buffers=max_buffers
                    )
                buffer = pool.try_acquire(engine.nbytes(tensor, region))
                if buffer is None:
                    held = item  # wait for a buffer to come back
                    break
                try:
                    wait = engine.start(tensor, region, buffer.raw)
                except BaseException:
                    pool.release(buffer)
                    raise
                queue.append(_Pending(key, tensor, region, wait, buffer, pool))
            if not queue:
                return
            head = queue.popleft()
            try:
                if head.tensor is None or head.region is None:
                    bits = None
                elif head.wait is None:
                    bits = head.tensor.read(head.region)
                else:
                    bits = head.wait()
                yield head.key, head.region, bits
            finally:
                if head.buffer is not None and head.pool is not None:
                    head.pool.release(head.buffer)
    finally:
        for pending in queue:  # copies still in flight must land before buffers are freed
            if pending.wait is not None:
                try:
                    pending.wait()
                except Exception:  # noqa: BLE001 - the first error is already propagating
                    pass
            if pending.buffer is not None and pending.pool is not None:
                pending.pool.release(pending.buffer)
        for pool in pools.values():
            pool.close()


__all__ = [
    "DEFAULT_BUFFER_BYTES", "MAX_BUFFERS", "BufferPool", "CopyEngine", "PooledBuffer", "staged",
]
