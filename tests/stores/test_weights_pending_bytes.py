"""Compressed chunks in flight are bounded by their bytes, not only by their count: a model's
small tensors (biases, norms) between two big chunks no longer hold the second back until the
first is written (issue 15's save speed: with a bound of 4 chunks, two big ones were in flight
at most, and one of the pool's two threads waited)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lean_store as ls
from lean_store.sources.numpy_source import ArraySourceTensor
from lean_store.stores import ordered_pool

GUARD_S = 30  # only a guard against a hang: the order is what is asserted
RNG = np.random.default_rng(16)


def _state() -> dict[str, np.ndarray]:
    """Two big tensors (one 256 KiB chunk each) with six small ones between them."""
    state = {"big0": RNG.standard_normal((64, 1024), dtype=np.float32)}
    state.update({f"small{i}": RNG.standard_normal(2048, dtype=np.float32) for i in range(6)})
    state["big1"] = RNG.standard_normal((64, 1024), dtype=np.float32)
    return state


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_big_chunk_queued_past_small_ones(tmp_path: Path, suffix: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The first big chunk finishes compressing only once the second is queued: the six
    small chunks between them do not make the caller wait for the first."""
    big = 64 * 1024 * 4
    first_started = threading.Event()
    second_queued = threading.Event()
    order: list[str] = []
    real_submit = ordered_pool.OrderedPool.submit

    def submit(self: Any, put: Any, encode: Any, chunk: np.ndarray, *args: Any) -> None:
        def gated(chunk: np.ndarray, *args: Any) -> Any:
            if chunk.nbytes == big and not first_started.is_set():
                first_started.set()
                order.append("second queued first" if second_queued.wait(GUARD_S)
                             else "first finished alone")
            return encode(chunk, *args)

        if chunk.nbytes == big and first_started.is_set():
            second_queued.set()
        return real_submit(self, put, gated, chunk, *args)

    monkeypatch.setattr(ordered_pool.OrderedPool, "submit", submit)
    if suffix == ".zarr":  # Zarr queues the chunks of units copied in order
        monkeypatch.setattr(ArraySourceTensor, "stable_reads", False)
    state = _state()
    path = tmp_path / f"ck{suffix}"
    ls.save(state, path, compression="weights", chunk_bytes=256 << 10)
    assert order == ["second queued first"]
    back = ls.load_state(path)
    for name, value in state.items():
        assert back[name].tobytes() == value.tobytes(), name


class _LazyPool:
    """A stand-in executor: a chunk is compressed only when the caller waits for it, so the
    queue's length at each wait is exactly its bound."""

    def __init__(self) -> None:
        self.waiting: list[tuple[Future, Any, tuple[Any, ...]]] = []

    def submit(self, fn: Any, *args: Any) -> Future:
        future: Future = Future()
        self.waiting.append((future, fn, args))
        return future

    def finish_oldest(self) -> None:
        future, fn, args = self.waiting.pop(0)
        future.set_result(fn(*args))


def test_pending_bounded_by_bytes_and_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small chunks pile up to :data:`MAX_PENDING_CHUNKS`, big ones only while their bytes
    stay within :data:`MAX_PENDING_BYTES` (:data:`MAX_PENDING` at least); every result is
    handed on in order."""
    pool = _LazyPool()
    queue = ordered_pool.OrderedPool(pool)  # type: ignore[arg-type]
    lengths: list[int] = []
    real_put_oldest = ordered_pool.OrderedPool._put_oldest

    def put_oldest(self: Any) -> None:
        lengths.append(len(self._pending))
        pool.finish_oldest()  # the oldest chunk's compression ends once the caller waits
        real_put_oldest(self)

    monkeypatch.setattr(ordered_pool.OrderedPool, "_put_oldest", put_oldest)
    got: list[int] = []
    for i in range(300):
        queue.submit(got.append, lambda chunk, i=i: i, np.zeros(16, np.uint8))
    assert lengths and set(lengths) == {ordered_pool.MAX_PENDING_CHUNKS + 1}
    queue.flush()
    lengths.clear()
    big = np.zeros(ordered_pool.MAX_PENDING_BYTES // 2, np.uint8)
    for i in range(300, 310):
        queue.submit(got.append, lambda chunk, i=i: i, big)
    assert lengths and set(lengths) == {ordered_pool.MAX_PENDING + 1}
    queue.flush()
    assert got == list(range(310))
