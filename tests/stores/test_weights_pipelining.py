"""How compressed saves schedule their chunks (issue 15's speed targets): one tensor's chunks
compress on the pool while the next tensors are added and written, on both backends."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import lean_store as ls
from lean_store.stores import ordered_pool

GUARD_S = 30  # only a guard against a hang: the order is what is asserted


@pytest.mark.parametrize("compression", ["weights", "weights-gzip"])
def test_hdf5_chunks_compress_across_tensors(tmp_path, monkeypatch, compression):
    """A tensor's last chunk is still compressing when the next tensor's chunk is queued:
    closing a tensor does not wait for its chunks (before, each tensor waited, so a model of
    single-chunk tensors compressed one chunk at a time on a two-thread pool)."""
    second_queued = threading.Event()
    order: list[str] = []
    real_submit = ordered_pool.OrderedPool.submit

    def submit(self, put, encode, chunk, *args):
        def gated(chunk, *args):
            if not order:  # the first chunk: finish only once a later one is queued
                order.append("first started")
                order.append("second queued first" if second_queued.wait(GUARD_S)
                             else "first finished alone")
            return encode(chunk, *args)

        if order:
            second_queued.set()
        return real_submit(self, put, gated, chunk, *args)

    monkeypatch.setattr(ordered_pool.OrderedPool, "submit", submit)
    rng = np.random.default_rng(0)
    state = {f"w{i}": rng.standard_normal((64, 1024)).astype(np.float32) for i in range(3)}
    path = tmp_path / "m.h5"
    ls.save(state, path, compression=compression, chunk_bytes=256 << 10)  # a chunk per tensor
    assert order == ["first started", "second queued first"]
    got = ls.load_state(path)
    for name, value in state.items():
        np.testing.assert_array_equal(got[name], value)
