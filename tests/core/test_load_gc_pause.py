"""Single-process loads pause Python's cyclic garbage collector while they run (a load of tens of
thousands of tensors spent ~25 % of its time in collections finding no cycles) and restore it
after: on success, when the load is refused, and leaving a collector the caller switched off,
off. ``ls.open`` pauses it while it opens (and reads every record), not while the handle is
held. Saves leave it alone (measured: no gain)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import lean_store as ls
from lean_store.checkpoint import Checkpoint

STATE = {"a": np.arange(6, dtype=np.float32), "b": np.ones((2, 3))}


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """gc.isenabled() at every tensor a load reads."""
    states: list[bool] = []
    real = Checkpoint.read_bits

    def spy(self, name, *args, **kwargs):
        states.append(gc.isenabled())
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(Checkpoint, "read_bits", spy)
    return states


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_load_state_and_load_pause_the_collector(tmp_path, seen, suffix) -> None:
    path = tmp_path / f"s{suffix}"
    ls.save(STATE, path)
    assert gc.isenabled()
    ls.load_state(path)
    into = {k: np.zeros_like(v) for k, v in STATE.items()}
    ls.load(into, path)
    assert seen and not any(seen)
    assert gc.isenabled()
    assert all(np.array_equal(into[k], v) for k, v in STATE.items())


def test_a_refused_load_restores_the_collector(tmp_path, seen) -> None:
    path = tmp_path / "s.h5"
    ls.save(STATE, path)
    with pytest.raises(ls.LayoutError):
        ls.load({"a": np.zeros(5, np.float32)}, path)
    with pytest.raises(ls.CheckpointError):
        ls.load_state(tmp_path / "missing.h5")
    assert gc.isenabled()


def test_a_collector_the_caller_switched_off_stays_off(tmp_path, seen) -> None:
    path = tmp_path / "s.zarr"
    ls.save(STATE, path)
    gc.disable()
    try:
        ls.load_state(path)
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert seen and not any(seen)


def test_load_training_pauses_the_collector(tmp_path, monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    from lean_store.training import state as training_state

    model = torch.nn.Linear(3, 2)
    path = tmp_path / "t.h5"
    ls.save_training(path, model=model, rng=False)
    states: list[bool] = []
    real = training_state.prepare_load

    def spy(*args, **kwargs):
        states.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(training_state, "prepare_load", spy)
    other = torch.nn.Linear(3, 2)
    ls.load_training(path, model=other, rng=False)
    assert states == [False] and gc.isenabled()
    assert torch.equal(other.weight, model.weight)


def test_open_pauses_the_collector_while_it_opens_only(tmp_path, monkeypatch) -> None:
    path = tmp_path / "s.zarr"
    ls.save(STATE, path)
    states: list[bool] = []
    real = Checkpoint._open

    def spy(self, *args):
        states.append(gc.isenabled())
        return real(self, *args)

    monkeypatch.setattr(Checkpoint, "_open", spy)
    with ls.open(path) as ck:
        assert states == [False]
        assert gc.isenabled()  # not while the handle is held
        assert np.array_equal(ck.read("a"), STATE["a"])
    assert gc.isenabled()
