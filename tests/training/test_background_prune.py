"""Steps dropped by ``keep_last`` leave the listing before ``save`` returns; their files are
removed by a background thread, never by another save's cleanup while that runs."""

from __future__ import annotations

import os
import threading
import time

import pytest
from torch_optional import require_torch

import lean_store as ls
from lean_store.training import checkpointer as checkpointer_module

torch = require_torch()

GUARD_S = 30  # only a guard against a hang


@pytest.mark.parametrize("backend", ["hdf5", "zarr"])
def test_dropped_step_is_unlisted_at_once_and_removed_in_the_background(tmp_path, monkeypatch,
                                                                        backend):
    release = threading.Event()
    started: list[str] = []
    real = checkpointer_module.remove_path

    def slow_remove(path):
        if ".lean_store-dead-" in path.name:
            started.append(path.name)
            assert release.wait(GUARD_S)
        real(path)

    monkeypatch.setattr(checkpointer_module, "remove_path", slow_remove)
    model = torch.nn.Linear(64, 64)
    ck = ls.Checkpointer(tmp_path / "run", keep_last=1, backend=backend,
                         incremental=backend == "zarr")
    ck.save(1, model=model, rng=False)
    ck.save(2, model=model, rng=False)  # drops step 1: returns while its removal waits
    assert ck.steps() == [2]
    hidden = [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".")]
    assert len(hidden) == 1 and ".lean_store-dead-" in hidden[0]
    ck.clean_incomplete()  # leaves the directory being removed alone
    assert (tmp_path / "run" / hidden[0]).exists()
    release.set()
    ck.finish_deletions()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [ck.path(2).name]
    assert started == hidden
    assert ls.verify(ck.path(2)).ok
    fresh = torch.nn.Linear(64, 64)
    ck.restore(model=fresh, rng=False)
    assert torch.equal(fresh.weight, model.weight)


def test_at_most_max_deleting_removals_at_once(tmp_path, monkeypatch):
    active, most = [0], [0]
    lock = threading.Lock()
    real = checkpointer_module.remove_path

    def counted(path):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            real(path)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(checkpointer_module, "remove_path", counted)
    model = torch.nn.Linear(8, 8)
    ck = ls.Checkpointer(tmp_path / "run", keep_last=1, backend="zarr")
    for step in range(8):
        ck.save(step, model=model, rng=False)
        assert len([f for f in ck._deleting.values() if not f.done()]) <= \
            checkpointer_module.MAX_DELETING
    ck.finish_deletions()
    assert ck.steps() == [7] and most[0] == 1  # one background thread
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [ck.path(7).name]


def test_a_leftover_gone_since_the_listing_is_neither_touched_nor_reported(tmp_path,
                                                                            monkeypatch):
    """clean_incomplete lists the directory, then removes leftovers one by one: a removal
    finished by the background thread in between must not be redone on the caller's thread
    (it ran beside the background one) nor reported as removed by this call."""
    ck = ls.Checkpointer(tmp_path / "run", keep_last=1, backend="zarr")
    ck.save(1, model=torch.nn.Linear(4, 4), rng=False)
    gone = ".step_0000000000.zarr.lean_store-dead-0123abcd"  # listed, no longer on disk
    left = tmp_path / "run" / ".step_0000000000.h5.lean_store-tmp-4567ef"
    left.write_bytes(b"left by a crashed save")
    days_ago = time.time() - 2 * 86400  # an older lean_store's naming: removed once stale
    os.utime(left, (days_ago, days_ago))
    real_listdir = checkpointer_module.os.listdir
    monkeypatch.setattr(checkpointer_module.os, "listdir",
                        lambda d: [*real_listdir(d), gone])
    calls: list[str] = []
    real = checkpointer_module.remove_path
    monkeypatch.setattr(checkpointer_module, "remove_path",
                        lambda p: (calls.append(p.name), real(p)))
    assert ck.clean_incomplete() == [left]
    assert calls == [left.name] and not left.exists()
    assert ck.steps() == [1]
