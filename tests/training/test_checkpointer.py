"""Checkpointer: step listing, keep-last-N, restore, and writers killed mid-save."""

from __future__ import annotations

import copy
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers import damage_stored_bytes, wait_for_child
from torch_optional import require_torch

import lean_store as ls

torch = require_torch()


def _run(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _step(model, opt):
    opt.zero_grad()
    model(torch.randn(6, 4)).pow(2).mean().backward()
    opt.step()


def test_keep_last_and_latest(tmp_path, backend):
    model, opt = _run()
    ck = ls.Checkpointer(tmp_path / "run", keep_last=2, backend=backend)
    assert ck.steps() == [] and ck.latest() is None
    for step in (1, 2, 5, 10, 11):
        _step(model, opt)
        path = ck.save(step, model=model, optimizer=opt, extra={"loss": step / 10})
        assert path.exists() and ck.latest() == step
    assert ck.steps() == [10, 11]
    ck.finish_deletions()  # the dropped steps' files, removed in the background
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        ck.path(10).name, ck.path(11).name
    ]  # nothing else: no temporaries, no pruned steps
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, fresh_opt = _run(seed=1)
    info = ck.restore(model=fresh, optimizer=fresh_opt)
    assert info.step == 11 and info.extra == {"loss": 1.1}
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())
    assert ck.restore(10, model=fresh).step == 10
    with pytest.raises(ls.CheckpointError, match="no committed checkpoint for step 5"):
        ck.restore(5, model=fresh)
    with pytest.raises(ls.CheckpointError, match="already exists"):
        ck.save(11, model=model, optimizer=opt)
    ck.save(11, model=model, optimizer=opt, overwrite=True)
    assert ck.steps() == [10, 11]


def test_a_damaged_latest_step_names_the_older_ones(tmp_path, backend):
    model, opt = _run()
    ck = ls.Checkpointer(tmp_path / "run", backend=backend)
    for step in range(3):
        _step(model, opt)
        ck.save(step, model=model, optimizer=opt)
    damage_stored_bytes(ck.path(2), model[0].weight.detach().numpy().tobytes()[:32], 8, 0xFF)
    fresh, fresh_opt = _run(seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ls.IntegrityError) as info:
        ck.restore(model=fresh, optimizer=fresh_opt)
    message = str(info.value)
    assert "'model/0.weight'" in message and "Older steps: [0, 1]" in message
    assert "restore(step=1" in message and "discard_after(1)" in message
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())  # untouched
    with pytest.raises(ls.IntegrityError) as info:  # a step asked for: its own error alone
        ck.restore(2, model=fresh)
    assert "Older steps" not in str(info.value)
    assert ck.restore(step=1, model=fresh, optimizer=fresh_opt).step == 1
    assert ck.discard_after(1) == [2]  # the damaged step, removed as the message says
    assert ck.steps() == [0, 1]
    ck.save(2, model=fresh, optimizer=fresh_opt)
    assert ck.restore(model=fresh).step == 2 and ls.verify(ck.path(2)).ok


def test_a_rewound_run_is_warned_and_never_prunes_the_step_it_saved(tmp_path, backend):
    """A run rolled back to an earlier step saves steps below the abandoned run's: each such
    save warns (latest() and restore() would pick the abandoned steps), the step just saved
    is never pruned (with keep_last=1 it was deleted at once, the save reporting success),
    and discard_after removes the abandoned steps."""
    import warnings

    model, opt = _run()
    ck = ls.Checkpointer(tmp_path / "run", keep_last=1, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # saves in increasing order warn of nothing
        for step in (100, 150):
            _step(model, opt)
            ck.save(step, model=model, optimizer=opt)
    with pytest.warns(UserWarning, match=r"holds later steps \(150\).*discard_after\(110\)"):
        path = ck.save(110, model=model, optimizer=opt)
    assert path.exists() and ck.steps() == [110]  # keep_last=1: the one just saved

    ck = ls.Checkpointer(tmp_path / "run2", keep_last=2, backend=backend)
    for step in (100, 140, 150):
        ck.save(step, model=model, optimizer=opt)
    assert ck.steps() == [140, 150]
    ck.restore(140, model=model, optimizer=opt)
    with pytest.warns(UserWarning, match=r"latest\(\) and restore\(\) still pick step 150"):
        ck.save(145, model=model, optimizer=opt)
    assert ck.steps() == [145, 150]  # 140 pruned, 145 kept
    assert ck.discard_after(145) == [150]
    assert ck.steps() == [145] and ck.latest() == 145
    assert ck.discard_after(145) == []
    ck.finish_deletions()
    assert sorted(p.name for p in (tmp_path / "run2").iterdir()) == [ck.path(145).name]


def test_a_checkpointer_that_pruned_can_be_copied_and_pickled(tmp_path):
    """After its first prune a Checkpointer holds the thread that removes dropped steps: a
    trainer holding it could no longer be deep-copied or pickled for a spawned process
    ("cannot pickle '_queue.SimpleQueue' object"). A copy uses the same directory and
    settings, without the original's removals in flight."""
    model = torch.nn.Linear(3, 2)
    run = ls.Checkpointer(tmp_path / "run", keep_last=1, backend="hdf5")
    run.save(1, model=model)
    run.save(2, model=model)  # prunes step 1 on its thread
    copied = copy.deepcopy(run)
    unpickled = pickle.loads(pickle.dumps(run))
    unpickled.save(3, model=model)
    assert copied.steps() == unpickled.steps() == run.steps() == [3]
    for each in (run, copied, unpickled):
        each.finish_deletions()
    assert sorted(os.listdir(tmp_path / "run")) == ["step_0000000003.h5"]


def test_unbounded_and_bad_arguments(tmp_path):
    model, opt = _run()
    _step(model, opt)
    ck = ls.Checkpointer(tmp_path, backend="hdf5")
    for step in range(4):
        ck.save(step, model=model)
    assert ck.steps() == [0, 1, 2, 3]
    with pytest.raises(ls.CheckpointError):
        ls.Checkpointer(tmp_path, keep_last=0)
    with pytest.raises(ls.CheckpointError):
        ls.Checkpointer(tmp_path, backend="pickle")
    with pytest.raises(ls.CheckpointError, match="step"):
        ck.save(-1, model=model)
    with pytest.raises(ls.CheckpointError, match=r"from 0 to 10\*\*19 - 1"):
        ck.save(10**19, model=model)  # too long for a step's name, not negative
    with pytest.raises(ls.CheckpointError, match="no committed"):
        ls.Checkpointer(tmp_path / "empty").restore(model=model)
    # a stray file that only looks like a step is not listed
    (tmp_path / "step_7.h5.partial").write_bytes(b"x")
    (tmp_path / ".step_0000000009.h5.lean_store-tmp-0123abcd").write_bytes(b"x")
    assert ck.steps() == [0, 1, 2, 3]


_CHILD = textwrap.dedent("""
    import sys, time
    import torch
    import lean_store as ls
    import lean_store.writing as core

    directory, backend, marker = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # 8 MiB
    ck = ls.Checkpointer(directory, backend=backend)
    ck.save(1, model=model)
    calls = [0]
    original = core.crc32c_of

    def stall(bits, crc=0):  # hang in the middle of the second save, after data was written
        calls[0] += 1
        if calls[0] == 6:
            open(marker, "w").close()
            time.sleep(600)
        return original(bits, crc)

    core.crc32c_of = stall
    ck.save(2, model=model)
""")


def test_writer_killed_mid_save_is_never_listed(tmp_path, backend):
    directory, marker = tmp_path / "run", tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(directory), backend, str(marker)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_child(marker.exists, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".")]
    assert len(leftovers) == 1 and ".lean_store-tmp-" in leftovers[0]  # killed mid-save
    ck = ls.Checkpointer(directory, backend=backend)
    assert ck.steps() == [1] and ck.latest() == 1
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    assert ck.restore(model=model).step == 1
    ck.save(3, model=model)  # the next save clears what the killed writer left behind
    assert ck.steps() == [1, 3]
    assert not [p for p in directory.iterdir() if p.name.startswith(".")]


_LOOP = textwrap.dedent("""
    import sys
    import torch
    import lean_store as ls

    directory, backend = sys.argv[1], sys.argv[2]
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    ck = ls.Checkpointer(directory, keep_last=2, backend=backend)
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
        ck.save(step, model=model)
""")


def test_writer_killed_at_any_moment_leaves_only_whole_steps(tmp_path, backend):
    directory = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", _LOOP, str(directory), backend],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ck = ls.Checkpointer(directory, backend=backend)
    wait_for_child(lambda: (ck.latest() or 0) >= 3, proc)
    os.kill(proc.pid, signal.SIGKILL)  # wherever it is: writing, committing or pruning
    proc.wait()
    steps = ck.steps()
    assert steps and steps[-1] >= 3
    for step in steps:
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
        assert ck.restore(step, model=model).step == step
        assert all(bool((p == step).all()) for p in model.parameters())
        with ls.open(ck.path(step)) as opened:
            opened.verify()


def test_steps_counted_in_numpy_or_torch_integers(tmp_path, backend):
    """A step counter kept as a numpy integer or a 0-d integer tensor is a step (refused
    before: "step must be an int"); bools, floats and strings are still refused."""
    import numpy as np

    model, opt = _run()
    _step(model, opt)
    ck = ls.Checkpointer(tmp_path / "run", backend=backend)
    assert ck.save(np.int64(5), model=model, optimizer=opt) == ck.path(5)
    ck.save(torch.tensor(7), model=model, optimizer=opt)
    assert ck.steps() == [5, 7] and all(type(s) is int for s in ck.steps())
    assert ck.restore(np.int32(5), model=model, optimizer=opt).step == 5
    for bad in (True, np.bool_(True), 6.0, "6", -1, torch.tensor(True)):
        with pytest.raises(ls.CheckpointError, match="step must be an int"):
            ck.save(bad, model=model, optimizer=opt)
    ls.save_training(tmp_path / f"t.{'zarr' if backend == 'zarr' else 'h5'}", model=model,
                     optimizer=opt, step=np.uint16(9))
    info = ls.load_training(tmp_path / f"t.{'zarr' if backend == 'zarr' else 'h5'}",
                            model=model, optimizer=opt)
    assert info.step == 9 and type(info.step) is int


def test_keep_every_keeps_milestones_besides_the_last_steps(tmp_path, backend):
    """``keep_every=N`` (Orbax's EveryNSteps beside LatestN, a long run's milestones): the
    multiples of N are never pruned, as well as (not instead of) the last keep_last steps."""
    model, opt = _run()
    _step(model, opt)
    ck = ls.Checkpointer(tmp_path / "run", keep_last=2, keep_every=3, backend=backend)
    kept = []
    for step in range(1, 11):
        ck.save(step, model=model, optimizer=opt, blocking=step % 2 == 0)
        ck.wait()
        kept.append(ck.steps())
    assert kept[4] == [3, 4, 5] and kept[7] == [3, 6, 7, 8] and kept[9] == [3, 6, 9, 10]
    ck.finish_deletions()
    assert all(ls.verify(ck.path(s)).ok for s in ck.steps())
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ls.CheckpointError, match="keep_every must be a positive int"):
            ls.Checkpointer(tmp_path / "other", keep_every=bad)


def test_keep_best_keeps_the_best_steps_by_a_metric(tmp_path, backend):
    """``keep_best=N, metric=..., mode=...`` (Lightning's save_top_k with monitor, Orbax's
    BestN): the N best steps by a metric in their ``extra`` are kept besides the last ones; a
    new Checkpointer on the directory (a restarted job) reads the metrics from the steps."""
    model, opt = _run()
    _step(model, opt)
    losses = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.2, 5: 0.6, 6: 0.7, 7: 0.8}
    ck = ls.Checkpointer(tmp_path / "run", keep_last=2, keep_best=2, metric="val_loss",
                         backend=backend)
    for step, loss in losses.items():
        ck.save(step, model=model, optimizer=opt, extra={"val_loss": loss},
                blocking=step % 2 == 1)
    ck.wait()
    assert ck.steps() == [2, 4, 6, 7]
    again = ls.Checkpointer(tmp_path / "run", keep_last=1, keep_best=1, metric="val_loss",
                            backend=backend)
    again.save(8, model=model, optimizer=opt)  # no metric: never among the best
    assert again.steps() == [4, 8]
    top = ls.Checkpointer(tmp_path / "top", keep_best=2, mode="max", backend=backend,
                          metric=lambda info: info.extra["acc"])
    for step, acc in ((1, 0.5), (2, 0.9), (3, 0.7), (4, 0.6)):
        top.save(step, model=model, optimizer=opt, extra={"acc": acc})
    assert top.steps() == [2, 3, 4]  # the best two and the latest (keep_last defaults to 1)
    for kwargs, match in (({"keep_best": 2}, "needs metric="),
                          ({"keep_best": 0, "metric": "x"}, "keep_best must be a positive"),
                          ({"keep_best": 2, "metric": "x", "mode": "lowest"}, "'min' or 'max'"),
                          ({"metric": "x"}, "keep_best=N, which was not given")):
        with pytest.raises(ls.CheckpointError, match=match):
            ls.Checkpointer(tmp_path / "bad", **kwargs)
