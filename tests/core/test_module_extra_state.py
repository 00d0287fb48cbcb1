"""A module's extra state (``get_extra_state``/``set_extra_state``, as TransformerEngine keeps its
FP8 scaling state: a pickled uint8 tensor whose length changes as training goes) is loaded as
torch's ``load_state_dict`` loads it: the saved tensor, of its saved shape, handed to
``set_extra_state``. Before, ``ls.load(module)`` copied the words into the temporary tensor
``get_extra_state`` had returned and the module never saw them, silently; with a length that
had changed, the load was refused. A state entry a state-dict hook makes (not the memory of
any parameter or buffer) cannot be loaded in place and is refused before anything changes."""

from __future__ import annotations

import pickle

import pytest
from torch_optional import require_torch

torch = require_torch()

import lean_store as ls  # noqa: E402
from lean_store.distributed import training_state  # noqa: E402

BACKENDS = [".h5", ".zarr"]


class Scaled(torch.nn.Module):
    """A linear layer with TransformerEngine-style extra state: its scaling history, pickled
    into a uint8 tensor (4 bytes while it has none)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.history: list[float] | None = None
        self.handed: list[torch.Tensor] = []

    def get_extra_state(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(pickle.dumps(self.history)), dtype=torch.uint8)

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.handed.append(state)
        self.history = pickle.loads(state.numpy().tobytes())


def _model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(Scaled(), torch.nn.ReLU(), Scaled())


def _trained() -> torch.nn.Sequential:
    model = _model(0)
    model[0].history = [0.5, 0.25, 2.0 ** -7]
    model[2].history = [float(i) for i in range(40)]
    return model


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("suffix", BACKENDS)
@pytest.mark.parametrize("verify", [True, False])
def test_extra_state_reaches_the_module(tmp_path, suffix, verify) -> None:
    saved = _trained()
    path = tmp_path / f"ck{suffix}"
    ls.save(saved, path)
    fresh = _model(1)  # other weights, no history: a 4-byte extra state
    assert fresh[0].get_extra_state().shape != saved[0].get_extra_state().shape
    result = ls.load(fresh, path, verify=verify)
    assert _same_weights(fresh, saved)
    assert fresh[0].history == saved[0].history and fresh[2].history == saved[2].history
    assert len(fresh[0].handed) == 1 and fresh[0].handed[0].dtype == torch.uint8
    assert "0._extra_state" in result.loaded and "2._extra_state" in result.loaded


@pytest.mark.parametrize("suffix", BACKENDS)
def test_extra_state_of_a_wrapped_module(tmp_path, suffix) -> None:
    saved = _trained()
    path = tmp_path / f"ck{suffix}"
    ls.save(torch.nn.DataParallel(saved), path)  # DataParallel's "module." is left out
    fresh = torch.nn.DataParallel(_model(1))
    ls.load(fresh, path)
    assert fresh.module[2].history == saved[2].history


@pytest.mark.parametrize("suffix", BACKENDS)
def test_load_state_like_a_module_returns_extra_state_as_saved(tmp_path, suffix) -> None:
    saved = _trained()
    path = tmp_path / f"ck{suffix}"
    ls.save(saved, path)
    fresh = _model(1)
    state = ls.load_state(path, like=fresh)
    assert torch.equal(state["2._extra_state"], saved[2].get_extra_state())
    fresh.load_state_dict(state)  # torch hands it to set_extra_state
    assert fresh[2].history == saved[2].history and _same_weights(fresh, saved)


@pytest.mark.parametrize("suffix", BACKENDS)
def test_training_checkpoints_restore_extra_state(tmp_path, suffix) -> None:
    saved = _trained()
    ls.save_training(tmp_path / f"t{suffix}", model=saved, step=7)
    fresh = _model(1)
    ls.load_training(tmp_path / f"t{suffix}", model=fresh)
    assert fresh[2].history == saved[2].history and _same_weights(fresh, saved)

    run = ls.Checkpointer(tmp_path / f"run{suffix.replace('.', '_')}",
                          backend="hdf5" if suffix == ".h5" else "zarr")
    run.save(3, model=saved)
    fresh = _model(2)
    run.restore(model=fresh)
    assert fresh[0].history == saved[0].history


@pytest.mark.parametrize("suffix", BACKENDS)
def test_a_training_state_dict_hands_extra_state_over(tmp_path, suffix) -> None:
    saved = _trained()
    path = tmp_path / f"ck{suffix}"
    ls.save(training_state(saved), path)
    fresh = _model(1)
    ls.load(training_state(fresh), path)
    assert fresh[2].history == saved[2].history and _same_weights(fresh, saved)


@pytest.mark.parametrize("suffix", BACKENDS)
def test_strict_false_without_stored_extra_state_leaves_it(tmp_path, suffix) -> None:
    path = tmp_path / f"ck{suffix}"
    class Plain(torch.nn.Module):  # Scaled's tensors, no extra state
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

    plain = torch.nn.Sequential(Plain(), torch.nn.ReLU(), Plain())
    ls.save(plain, path)
    fresh = _model(1)
    fresh[2].history = [1.0]
    with pytest.warns(UserWarning, match="skipped"):
        ls.load(fresh, path, strict=False)
    assert fresh[0].handed == [] and fresh[2].history == [1.0]
    assert torch.equal(fresh[0].fc.weight, plain[0].fc.weight)


def test_a_module_that_cannot_take_its_extra_state_is_refused_first(tmp_path) -> None:
    class OneWay(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

        def get_extra_state(self) -> torch.Tensor:
            return torch.zeros(3, dtype=torch.uint8)

    path = tmp_path / "ck.h5"
    ls.save(OneWay(), path)
    fresh = OneWay()
    before = fresh.fc.weight.clone()
    with pytest.raises(ls.UnsupportedValueError, match="set_extra_state"):
        ls.load(fresh, path)
    assert torch.equal(fresh.fc.weight, before)


def test_set_extra_state_failing_is_a_checkpoint_error(tmp_path) -> None:
    class Picky(Scaled):
        def set_extra_state(self, state: torch.Tensor) -> None:
            raise ValueError("unknown recipe")

    path = tmp_path / "ck.h5"
    ls.save(_trained(), path)
    fresh = torch.nn.Sequential(Picky(), torch.nn.ReLU(), Picky())
    with pytest.raises(ls.CheckpointError, match=r"set_extra_state.*'0\._extra_state'.*unknown"):
        ls.load(fresh, path)


@pytest.mark.parametrize("suffix", BACKENDS)
def test_a_hook_made_entry_is_refused_before_anything_changes(tmp_path, suffix) -> None:
    def as_float64(module, state, prefix, local_metadata):  # a copy, not the parameter
        state[prefix + "weight"] = state[prefix + "weight"].double()
        return state

    saved = torch.nn.Linear(3, 2)
    saved._register_state_dict_hook(as_float64)
    path = tmp_path / f"ck{suffix}"
    ls.save(saved, path)
    fresh = torch.nn.Linear(3, 2)
    fresh._register_state_dict_hook(as_float64)
    bias = fresh.bias.clone()
    with pytest.raises(ls.UnsupportedValueError, match=r"'weight'.*state-dict hook"):
        ls.load(fresh, path)
    assert torch.equal(fresh.bias, bias)  # nothing installed
    state = ls.load_state(path, like=fresh)  # the way the error names
    assert state["weight"].dtype == torch.float64
