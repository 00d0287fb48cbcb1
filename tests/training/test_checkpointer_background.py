"""``Checkpointer.save(..., blocking=False)``: a training loop's checkpoint written in the
background, as Orbax's CheckpointManager, DCP's ``async_save`` and Lightning's
AsyncCheckpointIO write theirs. Before, a Checkpointer's saves blocked (its ``snapshot`` option
was refused) and the only background save was ``save_training``'s, without ``keep_last``.
Everything is captured at the call; the step is written and the old steps pruned in the
background; one such save runs at a time, and its failure is raised by the next call."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch_optional import require_torch

import lean_store as ls

torch = require_torch()


def _run(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt):
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()


def _state(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items()})


@pytest.mark.parametrize("kind", ["hdf5", "zarr", "zarr-incremental"])
def test_each_step_holds_the_state_of_its_call(tmp_path: Path, kind: str) -> None:
    backend = kind.split("-")[0]
    ck = ls.Checkpointer(tmp_path / "run", keep_last=2, backend=backend,
                         incremental=kind.endswith("incremental"))
    model, opt = _run()
    saved = {}
    for step in range(1, 6):
        _step(model, opt)
        handle = ck.save(step, model=model, optimizer=opt, blocking=False,
                         extra={"step": step})
        assert isinstance(handle, ls.SaveHandle) and handle.path == ck.path(step)
        saved[step] = (_state(model, opt), torch.get_rng_state())
        _step(model, opt)  # training goes on at once: the step keeps the state of its call
    assert ck.wait() == ck.path(5) and ck.wait() is None
    assert ck.steps() == [4, 5]
    for step in (4, 5):
        assert ls.verify(ck.path(step)).ok
        fresh, fresh_opt = _run(seed=step)
        info = ck.restore(step, model=fresh, optimizer=fresh_opt)
        (weights, moments), rng = saved[step]
        assert info.extra == {"step": step}
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in weights.items())
        first = fresh_opt.state[next(iter(fresh.parameters()))]
        assert all(torch.equal(first[k], v) for k, v in moments.items())
        assert torch.equal(torch.get_rng_state(), rng)  # the RNG as it was at the call
    ck.finish_deletions()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        ck.path(4).name, ck.path(5).name]


def test_a_failed_background_save_is_raised_by_the_next_call(tmp_path: Path,
                                                             monkeypatch) -> None:
    import lean_store.async_save as async_save

    ck = ls.Checkpointer(tmp_path / "run", keep_last=3)
    model, opt = _run()
    _step(model, opt)
    ck.save(1, model=model, optimizer=opt)
    real = async_save.write_source

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(async_save, "write_source", full_disk)
    handle = ck.save(2, model=model, optimizer=opt, blocking=False)
    assert handle.exception(timeout=60) is not None
    with pytest.raises(OSError, match="No space left") as info:
        ck.save(3, model=model, optimizer=opt, blocking=False)
    assert "step_0000000002" in "".join(getattr(info.value, "__notes__", []))
    monkeypatch.setattr(async_save, "write_source", real)
    assert ck.steps() == [1]  # nothing of step 2, step 1 kept
    ck.save(3, model=model, optimizer=opt, blocking=False)  # the error was raised once
    assert ck.restore(model=_run(seed=3)[0], optimizer=None).step == 3  # waits for step 3
    assert ck.steps() == [1, 3]


def test_refusals_come_at_the_call(tmp_path: Path) -> None:
    ck = ls.Checkpointer(tmp_path / "run")
    model, opt = _run()
    _step(model, opt)
    ck.save(1, model=model, optimizer=opt)
    with pytest.raises(ls.CheckpointError, match="already exists"):
        ck.save(1, model=model, optimizer=opt, blocking=False)
    with pytest.raises(ls.CheckpointError, match="snapshot"):
        ck.save(2, model=model, optimizer=opt, snapshot="host")  # a blocking save copies nothing
    with pytest.raises(ls.CheckpointError, match="optimizer must be a torch optimizer"):
        ck.save(2, model=model, optimizer=model, blocking=False)
    assert ck.wait() is None and ck.steps() == [1]
    handle = ck.save(2, model=model, optimizer=opt, blocking=False, snapshot="host")
    assert handle.wait() is not None and ck.steps() == [1, 2]


def test_a_background_step_is_committed_and_pruned_at_interpreter_exit(tmp_path: Path) -> None:
    """The script ends right after its last save: the step is committed and the steps beyond
    keep_last are dropped before the interpreter goes away."""
    script = textwrap.dedent(f"""
        import torch, lean_store as ls
        model = torch.nn.Linear(256, 256)
        ck = ls.Checkpointer({str(tmp_path / "run")!r}, keep_last=1, backend="zarr")
        for step in (1, 2, 3):
            ck.save(step, model=model, blocking=False)
    """)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step_0000000003.zarr"]
    assert ls.verify(tmp_path / "run" / "step_0000000003.zarr").ok


def test_info_reads_a_step_without_changing_anything(tmp_path: Path, backend: str) -> None:
    """Choosing a step by a metric kept in ``extra``: ``Checkpointer.info`` and
    ``ls.training_info`` read a step's plain data without touching a model, an optimizer or
    the global RNG states (``load_training(path, model=None)`` restored those, rng=True being
    its default), and without reading its tensors."""
    import random

    ck = ls.Checkpointer(tmp_path / "run", backend=backend)
    model, opt = _run()
    for step, loss in ((10, 0.5), (20, 0.25), (30, 0.4)):
        _step(model, opt)
        ck.save(step, model=model, optimizer=opt, extra={"val_loss": loss},
                data={"epoch": step // 10}, blocking=step != 20)
    torch.manual_seed(1234)
    before = torch.get_rng_state(), random.getstate()
    best = min(ck.steps(), key=lambda s: ck.info(s).extra["val_loss"])
    assert best == 20 and ck.info().step == 30 and ck.info(20).data == {"epoch": 2}
    info = ls.training_info(ck.path(10))
    assert (info.step, info.extra, info.rng_restored) == (10, {"val_loss": 0.5}, False)
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    with pytest.raises(ls.CheckpointError, match="not an optimizer or training checkpoint"):
        ls.save({"w": torch.zeros(2)}, tmp_path / "plain.h5")
        ls.training_info(tmp_path / "plain.h5")
