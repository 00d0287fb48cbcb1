"""An evaluation job beside a training job: ``Checkpointer(run).restore(model=...)`` (the
latest step) while the training job saves on with ``keep_last``. A latest step pruned between
the listing and the read is gone, not an error to stop the evaluation: the step that is the
latest now is read instead (nothing is installed from a failed read). An explicit ``step=``
is read as asked, and fails if it is gone."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from torch_optional import needs_torch

import lean_store as ls
from lean_store.training import checkpointer as checkpointer_module

pytestmark = needs_torch  # training checkpoints are saved through torch


def _state(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full((4, 3), step, np.float32), "b": np.full(5, -step, np.float64)}


def _pruned_then_saved_on(monkeypatch, run: Path, backend: str, times: int = 1) -> list[Path]:
    """``load_training`` as seen from an evaluation job whose first ``times`` reads lose a
    race with the training job: the step it was about to read pruned, a newer one saved."""
    real = checkpointer_module.load_training
    trainer = ls.Checkpointer(run, keep_last=1, backend=backend)
    raced: list[Path] = []

    def racing(path, **kwargs):
        if len(raced) < times:
            raced.append(Path(path))
            step = max(trainer.steps()) + 1
            trainer.save(step, model=_state(step))  # keep_last=1: the one being read goes
            assert not Path(path).exists()
        return real(path, **kwargs)

    monkeypatch.setattr(checkpointer_module, "load_training", racing)
    return raced


@pytest.mark.parametrize("backend", ["hdf5", "zarr"])
def test_restore_of_the_latest_reads_the_latest_again_when_it_was_pruned(
        monkeypatch, tmp_path: Path, backend: str) -> None:
    run = tmp_path / "run"
    ls.Checkpointer(run, backend=backend).save(1, model=_state(1))
    raced = _pruned_then_saved_on(monkeypatch, run, backend)
    target = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(5, np.float64)}
    info = ls.Checkpointer(run, create=False, backend=backend).restore(model=target)
    assert raced and info.step == 2
    assert (target["w"] == 2).all() and (target["b"] == -2).all()


@pytest.mark.parametrize("backend", ["hdf5", "zarr"])
def test_an_explicit_step_that_was_pruned_is_not_swapped_for_another(
        monkeypatch, tmp_path: Path, backend: str) -> None:
    run = tmp_path / "run"
    ls.Checkpointer(run, backend=backend).save(1, model=_state(1))
    _pruned_then_saved_on(monkeypatch, run, backend)
    target = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(5, np.float64)}
    with pytest.raises(ls.CheckpointError, match="does not exist"):
        ls.Checkpointer(run, create=False, backend=backend).restore(1, model=target)
    assert (target["w"] == 0).all()  # nothing installed


def test_a_run_that_keeps_losing_the_race_raises_after_a_few_attempts(
        monkeypatch, tmp_path: Path) -> None:
    run = tmp_path / "run"
    ls.Checkpointer(run, backend="hdf5").save(1, model=_state(1))
    raced = _pruned_then_saved_on(monkeypatch, run, "hdf5",
                                  times=checkpointer_module.LATEST_ATTEMPTS)
    target = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(5, np.float64)}
    with pytest.raises(ls.CheckpointError, match="does not exist"):
        ls.Checkpointer(run, create=False, backend="hdf5").restore(model=target)
    assert len(raced) == checkpointer_module.LATEST_ATTEMPTS
    assert (target["w"] == 0).all()


def test_info_of_the_latest_reads_the_latest_again_when_it_was_pruned(tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainer = ls.Checkpointer(run, keep_last=1, backend="zarr")
    trainer.save(1, model=_state(1), extra={"loss": 1.0})
    evaluator = ls.Checkpointer(run, create=False, backend="zarr")
    real_find = evaluator._find
    calls: list[int] = []

    def find_then_prune(step):
        path = real_find(step)
        if not calls:  # the training job saves step 2 and prunes step 1 right after
            trainer.save(2, model=_state(2), extra={"loss": 0.5})
            shutil.rmtree(path, ignore_errors=True)
        calls.append(1)
        return path

    evaluator._find = find_then_prune  # type: ignore[method-assign]
    info = evaluator.info()
    assert info.step == 2 and info.extra == {"loss": 0.5} and len(calls) == 2
