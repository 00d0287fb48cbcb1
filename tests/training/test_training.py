"""Training state: optimizer moments, hyperparameters, schedulers, RNG, data position, resume."""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from torch_optional import require_torch

import lean_store as ls
from lean_store.sources import tensor_source
from lean_store.training.state import META_ATTR, VERSION_ATTR
from lean_store.writing import write_source

torch = require_torch()

HERE = Path(__file__).parent
TESTS = HERE.parent
FIXTURE = TESTS / "fixtures" / "legacy_v0_adam.h5"


def _model(width: int = 4) -> torch.nn.Module:
    layers = [torch.nn.Linear(3, width), torch.nn.Tanh(), torch.nn.Linear(width, 2)]
    return torch.nn.Sequential(*layers)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int = 2, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(5, 3, generator=gen)).pow(2).mean().backward()
        opt.step()


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def _same(a: object, b: object) -> bool:
    """Deep equality, tensors compared by dtype, shape and bits."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.numpy().tobytes() == b.numpy().tobytes())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _assert_unchanged(model: torch.nn.Module, opt: torch.optim.Optimizer, before: tuple) -> None:
    assert _same(model.state_dict(), before[0])
    assert _same(opt.state_dict(), before[1])


OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.95)),
    "adamw-amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True, weight_decay=0.1),
    "rmsprop-centered": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5, centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2, lr_decay=0.01),
    "adam-tensor-lr": lambda p: torch.optim.Adam(p, lr=torch.tensor(0.01)),
}


# ------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_round_trip_is_bit_exact(tmp_path, suffix, name):
    torch.manual_seed(0)
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    _steps(model, opt, 3)
    path = tmp_path / f"opt{suffix}"
    ls.save_optimizer(opt, path, model=model)
    with ls.open(path) as ck:
        assert ck.kind == "optimizer"
        assert ck.root_attrs[VERSION_ATTR] == 1
        names = set(ck.layout.names())
    assert "optimizer/state/0.weight/" + next(iter(opt.state_dict()["state"][0])) in names
    fresh = OPTIMIZERS[name](model.parameters())  # no state yet: expected from torch's rules
    info = ls.load_optimizer(fresh, path, model=model)
    assert info.rng_restored and info.kind == "optimizer"
    assert _same(fresh.state_dict(), opt.state_dict())
    # and both continue identically
    twin = copy.deepcopy(model)
    twin_opt = OPTIMIZERS[name](twin.parameters())
    ls.load_optimizer(twin_opt, path, model=twin)
    _steps(model, opt, 2, seed=5)
    _steps(twin, twin_opt, 2, seed=5)
    assert _same(model.state_dict(), twin.state_dict())
    assert _same(opt.state_dict(), twin_opt.state_dict())


def test_param_names_come_from_named_parameters(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    _steps(model, opt)
    path = tmp_path / "named.h5"
    ls.save_optimizer(opt, path)  # no model: torch's param_names
    with ls.open(path) as ck:
        meta = json.loads(ck.root_attrs[META_ATTR])
    names = [n for n, _ in model.named_parameters()]
    assert [p["name"] for p in meta["optimizer"]["params"]] == names
    fresh = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    ls.load_optimizer(fresh, path)
    assert _same(fresh.state_dict(), opt.state_dict())


def test_param_groups_and_unused_parameters(tmp_path):
    model = _model()
    frozen = torch.nn.Parameter(torch.ones(3))  # never gets a gradient: no state
    opt = torch.optim.Adam([
        {"params": [model[0].weight, model[0].bias, frozen], "lr": 1e-2},
        {"params": list(model[2].parameters()), "lr": 1e-3, "weight_decay": 0.5},
    ])
    _steps(model, opt)
    path = tmp_path / "groups.zarr"
    ls.save_optimizer(opt, path)
    fresh = torch.optim.Adam([
        {"params": [model[0].weight, model[0].bias, frozen], "lr": 1e-2},
        {"params": list(model[2].parameters()), "lr": 1e-3, "weight_decay": 0.5},
    ])
    ls.load_optimizer(fresh, path)
    assert _same(fresh.state_dict(), opt.state_dict())
    assert 2 not in fresh.state_dict()["state"]


class CountingSGD(torch.optim.Optimizer):
    """An optimizer lean_store has no rule for, keeping numbers and None in its state."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr, "tag": "counting", "sizes": (1, 2)})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                state["scale"] = 0.5 ** state["step"]
                state["flag"] = True
                state["note"] = None
                state["buf"] = state.get("buf", torch.zeros_like(p)) + p.grad
                p.sub_(group["lr"] * state["scale"] * state["buf"])


def test_number_steps_none_and_unknown_optimizer(tmp_path):
    model = _model()
    opt = CountingSGD(model.parameters())
    _steps(model, opt, 3)
    path = tmp_path / "count.h5"
    ls.save_optimizer(opt, path, model=model)
    with ls.open(path) as ck:
        step = ck["optimizer/state/0.weight/step"]
        assert step.shape == () and step.format.tag == "int64"
        assert ck["optimizer/state/0.weight/scale"].format.tag == "float64"
    fresh = CountingSGD(model.parameters())
    ls.load_optimizer(fresh, path, model=model)
    state = fresh.state_dict()["state"][0]
    assert type(state["step"]) is int and state["step"] == 3
    assert type(state["scale"]) is float and state["flag"] is True and state["note"] is None
    assert _same(fresh.state_dict(), opt.state_dict())


def test_state_that_is_not_tensors_or_numbers_is_refused(tmp_path):
    class Tagged(torch.optim.SGD):  # per-parameter state holding a dict: no pickle, refused
        def step(self, closure=None):
            out = super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["seen"] = {"epoch": 1}
            return out

    model = _model()
    opt = Tagged(model.parameters(), lr=0.1)
    _steps(model, opt)
    with pytest.raises(ls.CheckpointError, match="'seen' is a dict"):
        ls.save_optimizer(opt, tmp_path / "tagged.h5", model=model)
    assert not (tmp_path / "tagged.h5").exists()


def test_plain_sgd_without_state_can_be_saved(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _steps(model, opt)
    ls.save_optimizer(opt, tmp_path / "sgd.h5", model=model)
    fresh = torch.optim.SGD(model.parameters(), lr=0.1)
    ls.load_optimizer(fresh, tmp_path / "sgd.h5", model=model)
    assert _same(fresh.state_dict(), opt.state_dict())


def test_scheduled_learning_rate_is_restored_not_compared(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        _steps(model, opt, 1)
        sched.step()
    path = tmp_path / "lr.h5"
    ls.save_training(path, model=model, optimizer=opt, scheduler=sched, step=3)
    fresh = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh, step_size=1, gamma=0.5)
    ls.load_training(path, model=model, optimizer=fresh, scheduler=fresh_sched)
    assert fresh.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.1 * 0.5**3
    assert fresh_sched.state_dict() == sched.state_dict()
    # saved without a scheduler, loaded into an optimizer that has one: initial_lr stays live
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _steps(model, plain, 1)
    ls.save_optimizer(plain, tmp_path / "plain.h5", model=model)
    ls.load_optimizer(fresh, tmp_path / "plain.h5", model=model)
    assert fresh.param_groups[0]["initial_lr"] == 0.1 and fresh.param_groups[0]["lr"] == 0.1


# ------------------------------------------------------------------------------- rejections


def test_optimizer_without_state_is_refused(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(ls.CheckpointError, match="no state yet"):
        ls.save_optimizer(opt, tmp_path / "empty.h5")
    with pytest.raises(ls.CheckpointError, match="no state yet"):
        ls.save_training(tmp_path / "empty.zarr", model=model, optimizer=opt)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def saved_adamw(tmp_path):
    torch.manual_seed(1)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999))
    _steps(model, opt, 2)
    path = tmp_path / "adamw.h5"
    ls.save_training(path, model=model, optimizer=opt, step=2)
    return model, path


def _live(make_opt, width: int = 4, seed: int = 7):
    """A model and optimizer with state of their own, so 'unchanged' means something."""
    torch.manual_seed(seed)
    model = _model(width)
    opt = make_opt(model.parameters())
    _steps(model, opt, 1, seed=seed)
    return model, opt


def test_different_optimizer_kind_is_refused(saved_adamw):
    _, path = saved_adamw
    model, opt = _live(lambda p: torch.optim.Adam(p, lr=1e-2))
    before = _snapshot(model, opt)
    with pytest.raises(ls.LayoutError, match="optimizer class"):
        ls.load_training(path, model=model, optimizer=opt)
    _assert_unchanged(model, opt, before)


@pytest.mark.parametrize("change", [
    {"betas": (0.8, 0.999)}, {"weight_decay": 0.0}, {"amsgrad": True}, {"eps": 1e-7},
])
def test_mismatched_hyperparameters_are_refused(saved_adamw, change):
    _, path = saved_adamw
    settings = {"lr": 1e-2, "betas": (0.9, 0.999), **change}
    model, opt = _live(lambda p: torch.optim.AdamW(p, **settings))
    before = _snapshot(model, opt)
    with pytest.raises(ls.LayoutError) as err:
        ls.load_optimizer(opt, path, model=model)
    assert next(iter(change)) in str(err.value)
    _assert_unchanged(model, opt, before)


def test_missing_moment_tensor_is_refused(saved_adamw, tmp_path):
    _, path = saved_adamw
    state = ls.load_state(path)
    with ls.open(path) as ck:
        attrs = {VERSION_ATTR: 1, META_ATTR: ck.root_attrs[META_ATTR]}
    del state["optimizer/state/2.bias/exp_avg_sq"]
    forged = tmp_path / "forged.h5"
    write_source(tensor_source(state), forged, kind="training", extra_root=attrs)
    # and one whose metadata no longer lists the moment either
    meta = json.loads(attrs[META_ATTR])
    del meta["optimizer"]["state"]["2.bias"]["exp_avg_sq"]
    forged2 = tmp_path / "forged2.zarr"
    write_source(tensor_source(state), forged2, kind="training",
                 extra_root={VERSION_ATTR: 1, META_ATTR: json.dumps(meta)})
    for bad in (forged, forged2):
        model, opt = _live(lambda p: torch.optim.AdamW(p, lr=1e-2))
        before = _snapshot(model, opt)
        with pytest.raises(ls.LayoutError, match="2.bias/exp_avg_sq"):
            ls.load_training(bad, model=model, optimizer=opt)
        _assert_unchanged(model, opt, before)
        fresh_model = _model()
        fresh = torch.optim.AdamW(fresh_model.parameters(), lr=1e-2)  # expected from the rules
        before = _snapshot(fresh_model, fresh)
        with pytest.raises(ls.LayoutError, match="2.bias/exp_avg_sq"):
            ls.load_training(bad, model=fresh_model, optimizer=fresh)
        _assert_unchanged(fresh_model, fresh, before)


def test_optimizer_of_a_different_model_is_refused(saved_adamw):
    _, path = saved_adamw
    model, opt = _live(lambda p: torch.optim.AdamW(p, lr=1e-2), width=5)
    before = _snapshot(model, opt)
    with pytest.raises(ls.LayoutError) as err:
        ls.load_optimizer(opt, path, model=model)
    assert "0.weight" in str(err.value) and "[5, 3]" in str(err.value)
    _assert_unchanged(model, opt, before)
    # the same shapes under other names
    renamed = torch.nn.Sequential()
    renamed.add_module("a", torch.nn.Linear(3, 4))
    renamed.add_module("b", torch.nn.Tanh())
    renamed.add_module("c", torch.nn.Linear(4, 2))
    opt2 = torch.optim.AdamW(renamed.parameters(), lr=1e-2)
    _steps(renamed, opt2)
    before = _snapshot(renamed, opt2)
    with pytest.raises(ls.LayoutError, match="parameter name"):
        ls.load_optimizer(opt2, path, model=renamed)
    _assert_unchanged(renamed, opt2, before)


def test_model_mismatch_in_training_checkpoint_changes_nothing(saved_adamw):
    _, path = saved_adamw
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt)
    before = _snapshot(model, opt)
    with pytest.raises(ls.LayoutError):
        ls.load_training(path, model=model, optimizer=opt)
    _assert_unchanged(model, opt, before)


def test_corrupt_moment_changes_nothing(saved_adamw):
    _, path = saved_adamw
    import h5py

    with h5py.File(path, "r+") as f:
        ds = f["optimizer%2Fstate%2F0.weight%2Fexp_avg"]
        raw = ds[...]
        raw.view(np.uint32).flat[0] ^= 1
        ds[...] = raw  # the recorded crc32c digest now disagrees
    model, opt = _live(lambda p: torch.optim.AdamW(p, lr=1e-2))
    before = _snapshot(model, opt)
    with pytest.raises(ls.IntegrityError, match="crc32c"):
        ls.load_training(path, model=model, optimizer=opt)
    _assert_unchanged(model, opt, before)


def test_not_a_training_checkpoint(tmp_path):
    model = _model()
    ls.save(model, tmp_path / "m.h5")
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(ls.CheckpointError, match="not an optimizer or training"):
        ls.load_optimizer(opt, tmp_path / "m.h5")


def test_newer_training_format_is_refused(saved_adamw, tmp_path):
    _, path = saved_adamw
    with ls.open(path) as ck:
        text = ck.root_attrs[META_ATTR]
    newer = tmp_path / "newer.h5"
    write_source(tensor_source(ls.load_state(path)), newer, kind="training",
                 extra_root={VERSION_ATTR: 99, META_ATTR: text})
    model, opt = _live(lambda p: torch.optim.AdamW(p, lr=1e-2))
    with pytest.raises(ls.IntegrityError, match="newer"):
        ls.load_training(newer, model=model, optimizer=opt)


# ------------------------------------------------------------------------------------- RNG


def test_rng_states_are_restored(tmp_path, suffix):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _steps(model, opt)
    np_gen = np.random.default_rng(123)
    torch_gen = torch.Generator().manual_seed(9)
    legacy = np.random.RandomState(5)
    py_gen = random.Random(11)  # random.Random objects too (refused before)
    philox = np.random.Generator(np.random.Philox(7))  # any numpy bit generator
    np_gen.random(3)
    torch.rand(2, generator=torch_gen)
    py_gen.gauss(0, 1)  # a normal pending in its state
    gens = {"np": np_gen, "torch": torch_gen, "legacy": legacy, "py": py_gen, "philox": philox}
    path = tmp_path / f"rng{suffix}"
    ls.save_optimizer(opt, path, model=model, generators=gens)

    def draw():
        return (torch.rand(4).tolist(), np.random.rand(3).tolist(), random.random(),
                np_gen.random(2).tolist(), torch.rand(2, generator=torch_gen).tolist(),
                legacy.rand(2).tolist(), torch.nn.functional.dropout(torch.ones(16), 0.5).tolist(),
                py_gen.gauss(0, 1), py_gen.random(), philox.random(2).tolist())

    expected = draw()
    draw()  # move every generator on
    ls.load_optimizer(opt, path, model=model, generators=gens)
    assert draw() == expected


def test_a_system_random_has_no_state_and_is_refused_by_name(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _steps(model, opt)
    with pytest.raises(ls.CheckpointError, match="SystemRandom has no state"):
        ls.save_optimizer(opt, tmp_path / "sys.h5", model=model,
                          generators={"sys": random.SystemRandom()})
    assert not (tmp_path / "sys.h5").exists()


def test_file_without_rng_warns(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    _steps(model, opt)
    ls.save_optimizer(opt, tmp_path / "norng.h5", rng=False, model=model)
    fresh = torch.optim.Adam(model.parameters())
    with pytest.warns(UserWarning, match="stochastic continuation cannot be reproduced"):
        info = ls.load_optimizer(fresh, tmp_path / "norng.h5", model=model)
    assert not info.rng_restored
    assert _same(fresh.state_dict(), opt.state_dict())


def test_legacy_v0_fixture_loads_with_warning():
    assert FIXTURE.is_file() and FIXTURE.stat().st_size < 50_000
    with ls.open(FIXTURE) as ck:
        assert VERSION_ATTR not in ck.root_attrs and "rng/torch_cpu" not in ck.layout
    stored = ls.load_state(FIXTURE)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.warns(UserWarning, match="moments .* restored.*cannot be reproduced"):
        info = ls.load_optimizer(opt, FIXTURE, model=model)
    assert info.format_version == 0 and not info.rng_restored
    state = opt.state_dict()["state"]
    for index, name in enumerate(["weight", "bias"]):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert state[index][key].numpy().tobytes() == stored[f"state/{name}/{key}"].tobytes()


def test_legacy_fixture_is_reproducible(tmp_path, capsys):
    """What the fixture stores is exactly what lean_store loads from it; the tool that wrote it
    still writes the same checkpoint. Its training results are recomputed, so they are
    compared as numbers (a CPU's float kernels may differ from another's by an ULP or two),
    while everything meant to be exact (layout, metadata, step counts) is compared exactly."""
    import importlib.util

    import h5py

    from lean_store.integrity import crc32c_of

    stored = ls.load_state(FIXTURE)
    with h5py.File(FIXTURE, "r") as f:  # the file's own bytes, read without lean_store
        raw = {ds.attrs["name"].decode(): ds for ds in f.values()}
        assert sorted(raw) == sorted(stored)
        for name, value in stored.items():
            words = raw[name][()].reshape(value.shape)
            assert words.dtype == value.dtype and words.tobytes() == value.tobytes(), name
            assert crc32c_of(words) == int(raw[name].attrs["crc32c"]), name

    spec = importlib.util.spec_from_file_location(
        "make_legacy_fixture", TESTS.parent / "tools" / "make_legacy_fixture.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "again.h5"
    tool.main(out)
    again = ls.load_state(out)
    with ls.open(FIXTURE) as old, ls.open(out) as new:
        assert [(e.name, e.shape, e.format) for e in old.layout] == \
            [(e.name, e.shape, e.format) for e in new.layout]
        assert json.loads(old.root_attrs["optimizer"]) == json.loads(new.root_attrs["optimizer"])
        assert old.root_attrs["kind"] == new.root_attrs["kind"]
    for name, value in stored.items():
        if name.endswith("/step"):
            assert again[name].tobytes() == value.tobytes(), name  # a count: exact
        else:
            np.testing.assert_allclose(again[name], value, rtol=1e-5, atol=1e-12, err_msg=name)


# ------------------------------------------------------- scheduler, data position, extras


class Position:
    def __init__(self):
        self.epoch, self.index = 0, 0

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state):
        self.epoch, self.index = state["epoch"], state["index"]


def test_training_checkpoint_round_trip(tmp_path, suffix):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
    for _ in range(4):
        _steps(model, opt, 1)
        sched.step()
    pos = Position()
    pos.epoch, pos.index = 2, 17
    extra = {"loss": 0.25, "best": float("inf"), "history": [1, 2.5, None], "pair": (3, "x"),
             "big": 2**70, "ids": {1: "a"}, "weights": np.arange(3, dtype=np.float32)}
    path = tmp_path / f"train{suffix}"
    ls.save_training(path, model=model, optimizer=opt, scheduler=sched, step=4, data=pos,
                     extra=extra)
    model2 = _model()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=0.1, total_steps=20)
    pos2 = Position()
    info = ls.load_training(path, model=model2, optimizer=opt2, scheduler=sched2, data=pos2)
    assert info.step == 4 and (pos2.epoch, pos2.index) == (2, 17)
    assert info.extra["big"] == 2**70 and info.extra["pair"] == (3, "x")
    assert info.extra["ids"] == {1: "a"} and info.extra["best"] == float("inf")
    np.testing.assert_array_equal(info.extra["weights"], extra["weights"])
    assert info.extra["weights"].dtype == np.float32
    assert _same(model2.state_dict(), model.state_dict())
    assert _same(opt2.state_dict(), opt.state_dict())
    assert sched2.state_dict() == sched.state_dict()


def test_data_position_generator_and_mapping(tmp_path):
    model = _model()
    gen = torch.Generator().manual_seed(3)
    torch.rand(5, generator=gen)
    ls.save_training(tmp_path / "g.h5", model=model, data=gen)
    expected = torch.rand(3, generator=gen)
    ls.load_training(tmp_path / "g.h5", model=model, data=gen)
    assert torch.equal(torch.rand(3, generator=gen), expected)
    ls.save_training(tmp_path / "m.h5", model=model, data={"epoch": 1, "index": 9})
    target = {"stale": True}
    info = ls.load_training(tmp_path / "m.h5", model=model, data=target)
    assert target == {"epoch": 1, "index": 9} == info.data
    with pytest.raises(ls.CheckpointError, match="saved as"):
        ls.load_training(tmp_path / "m.h5", model=model, data=Position())


def test_unstorable_values_are_refused(tmp_path):
    model = _model()
    with pytest.raises(ls.CheckpointError, match="without pickle"):
        ls.save_training(tmp_path / "x.h5", model=model, extra={"f": lambda: 1})
    with pytest.raises(ls.CheckpointError, match="step"):
        ls.save_training(tmp_path / "x.h5", model=model, step=-1)
    assert not (tmp_path / "x.h5").exists()


def test_scheduler_mismatch_is_refused(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    _steps(model, opt)
    ls.save_training(tmp_path / "s.h5", model=model, optimizer=opt, scheduler=sched)
    model2, opt2 = _live(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    other = torch.optim.lr_scheduler.ExponentialLR(opt2, 0.9)
    before = _snapshot(model2, opt2)
    with pytest.raises(ls.LayoutError, match="scheduler class"):
        ls.load_training(tmp_path / "s.h5", model=model2, optimizer=opt2, scheduler=other)
    _assert_unchanged(model2, opt2, before)


def test_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None; import lean_store as ls; "
            "print(ls.save_training.__name__, ls.Checkpointer.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["save_training", "Checkpointer"]


# ----------------------------------------------------------------------------- exact resume

import resume_helper  # noqa: E402  (tests/, on pytest's pythonpath)

RESUME_K = 5


def test_exact_resume_in_a_fresh_process(tmp_path, suffix):
    """2k steps in one process == k steps, save, and k more in a fresh process: bitwise."""
    suffix = suffix
    kinds = ["adamw", "adam", "sgd"]
    jobs = []
    for kind in kinds:
        run = resume_helper.build(kind)
        resume_helper.train(run, 2 * RESUME_K)
        resume_helper.save(run, tmp_path / f"full-{kind}{suffix}", 2 * RESUME_K)
        run = resume_helper.build(kind)
        resume_helper.train(run, RESUME_K)
        resume_helper.save(run, tmp_path / f"half-{kind}{suffix}", RESUME_K)
        jobs += [kind, str(tmp_path / f"half-{kind}{suffix}"),
                 str(tmp_path / f"res-{kind}{suffix}")]
    result = subprocess.run(
        [sys.executable, str(TESTS / "resume_helper.py"), str(RESUME_K), *jobs],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    for kind in kinds:
        full = ls.load_state(tmp_path / f"full-{kind}{suffix}")
        resumed = ls.load_state(tmp_path / f"res-{kind}{suffix}")
        assert list(full) == list(resumed)
        assert any(n.startswith("optimizer/state/") for n in full)
        differing = [n for n in full if full[n].tobytes() != resumed[n].tobytes()]
        assert differing == [], kind  # parameters, moments, steps, RNG, data position: bitwise
        with ls.open(tmp_path / f"full-{kind}{suffix}") as a, \
                ls.open(tmp_path / f"res-{kind}{suffix}") as b:
            assert a.root_attrs[META_ATTR] == b.root_attrs[META_ATTR], kind  # lr, scheduler


def test_resume_without_rng_diverges(tmp_path):
    """The control: the exact-resume test can fail. Without the RNG state dropout differs."""
    run = resume_helper.build("adamw")
    resume_helper.train(run, 2 * RESUME_K)
    full = {k: v.clone() for k, v in run["model"].state_dict().items()}
    run = resume_helper.build("adamw")
    resume_helper.train(run, RESUME_K)
    resume_helper.save(run, tmp_path / "half.h5", RESUME_K)
    run = resume_helper.build("adamw")
    torch.manual_seed(1234)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ls.load_training(tmp_path / "half.h5", rng=False, **run)
    resume_helper.train(run, RESUME_K)
    assert not _same(run["model"].state_dict(), full)


def test_parts_of_the_wrong_kind_are_refused_by_name(tmp_path) -> None:
    """An optimizer passed as the model (or a model as the optimizer), a number as the
    scheduler or as ``generators``: a CheckpointError naming the part, before anything is
    written or changed (these raised AttributeError from deep inside the save)."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "t.h5"
    for kwargs, what in [({"optimizer": model}, "optimizer must be a torch optimizer"),
                         ({"scheduler": 3}, "scheduler must have state_dict"),
                         ({"generators": 5}, "generators must map names")]:
        with pytest.raises(ls.CheckpointError, match=what):
            ls.save_training(path, model=model, **kwargs)
        assert not path.exists()
    with pytest.raises(ls.CheckpointError, match="optimizer must be a torch optimizer"):
        ls.save_optimizer(model, path)
    ls.save_training(path, model=model, optimizer=opt)
    before = model.weight.detach().clone()
    with pytest.raises(ls.CheckpointError, match="optimizer must be a torch optimizer"):
        ls.load_training(path, model=model, optimizer=model)
    assert torch.equal(model.weight, before)
