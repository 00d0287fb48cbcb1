"""Wrapped modules (``torch.compile``, DistributedDataParallel, DataParallel): their tensors are
named without what the wrapper adds (``_orig_mod``, ``module.``; lean_store/sources/
module_names.py), so one checkpoint serves the model wrapped or not; checkpoints saved with
those names (before) still load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch_optional import needs_torch, torch

import lean_store as ls
from lean_store.sources.module_names import canonical_name, canonical_state, spelled_as

SUFFIXES = (".h5", ".zarr")


# ------------------------------------------------------------------ names alone (no torch)


def test_canonical_names() -> None:
    assert canonical_name("_orig_mod.0.weight") == "0.weight"
    assert canonical_name("blocks.0._orig_mod.attn.w") == "blocks.0.attn.w"
    assert canonical_name("_orig_mod._orig_mod.w") == "w"  # compiled twice
    assert canonical_name("my_orig_mod.w") == "my_orig_mod.w"  # a component, not a substring
    assert canonical_name("w") == "w"


def test_two_names_that_become_one_are_refused() -> None:
    state = {"w": 1, "_orig_mod.w": 2}
    with pytest.raises(ls.CheckpointError, match="'w' and '_orig_mod.w'"):
        canonical_state(state)
    plain = {"a": 1}
    assert canonical_state(plain) is plain


def test_spelled_as_a_parallel_modules_state() -> None:
    stored = ["module.0.w", "module.1.w"]
    assert spelled_as(["0.w", "1.w"], stored) == {"0.w": "module.0.w", "1.w": "module.1.w"}
    # a submodule of one's own called ``module``: not every name starts so, nothing mapped
    assert spelled_as(["0.w"], ["module.0.w", "head.w"]) == {}


def test_spelled_as_follows_the_checkpoint() -> None:
    assert spelled_as(["0.w", "1.w"], ["0.w", "1.w"]) == {}
    assert spelled_as(["0.w", "1.w"], ["_orig_mod.0.w", "_orig_mod.1.w"]) == {
        "0.w": "_orig_mod.0.w", "1.w": "_orig_mod.1.w"}
    # a name the checkpoint holds as it is keeps it
    assert spelled_as(["0.w", "1.w"], ["0.w", "_orig_mod.1.w"]) == {"1.w": "_orig_mod.1.w"}


# ------------------------------------------------------------------------- torch modules


def _net(seed: int) -> Any:
    assert torch is not None
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5),
                               torch.nn.Linear(5, 3))


def _same(a: Any, b: Any) -> bool:
    sa, sb = dict(a.state_dict()), dict(b.state_dict())
    sa = {canonical_name(k): v for k, v in sa.items()}
    sb = {canonical_name(k): v for k, v in sb.items()}
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@needs_torch
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_one_checkpoint_for_the_model_compiled_or_not(tmp_path: Path, suffix: str) -> None:
    model = _net(0)
    compiled = torch.compile(model)
    assert next(iter(compiled.state_dict())).startswith("_orig_mod.")
    path = tmp_path / f"c{suffix}"
    ls.save(compiled, path)
    assert ls.open(path).layout.names() == list(model.state_dict())  # no _orig_mod
    for target in (_net(1), torch.compile(_net(2))):
        assert not _same(target, model)
        ls.load(target, path)
        assert _same(target, model)
    back = ls.load_state(path, like=torch.compile(_net(3)))
    assert list(back) == list(model.state_dict())
    eager = tmp_path / f"eager{suffix}"
    ls.save(model, eager)  # the same names from the model uncompiled
    assert ls.open(eager).layout.names() == ls.open(path).layout.names()
    compiled_again = torch.compile(_net(4))
    ls.load(compiled_again, eager)
    assert _same(compiled_again, model)


@needs_torch
def test_a_compiled_submodule(tmp_path: Path) -> None:
    model = _net(0)
    model[2] = torch.compile(model[2])
    assert "2._orig_mod.weight" in model.state_dict()
    ls.save(model, tmp_path / "c.h5")
    assert "2.weight" in ls.open(tmp_path / "c.h5").layout.names()
    plain = _net(5)
    ls.load(plain, tmp_path / "c.h5")
    assert _same(plain, model)


@needs_torch
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_checkpoints_saved_with_orig_mod_names_still_load(tmp_path: Path, suffix: str) -> None:
    model = _net(0)
    compiled = torch.compile(model)
    path = tmp_path / f"old{suffix}"
    ls.save(dict(compiled.state_dict()), path)  # the names lean_store stored before
    assert ls.open(path).layout.names()[0] == "_orig_mod.0.weight"
    for target in (torch.compile(_net(1)), _net(2)):
        ls.load(target, path)
        assert _same(target, model)
    back = ls.load_state(path, like=_net(3))  # keyed as the module names them
    assert list(back) == list(model.state_dict())
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ls.LayoutError):  # a real difference is still one
        ls.load(torch.nn.Linear(6, 5), path)


def _trained(seed: int) -> tuple[Any, Any, Any]:
    """(model, its compiled wrapper, AdamW over the wrapper's parameters after two steps)."""
    model = _net(seed)
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    for _ in range(2):  # through the module itself: no compilation needed
        model(torch.randn(4, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, compiled, opt


def _same_moments(opt_a: Any, a: Any, opt_b: Any, b: Any) -> bool:
    pairs = zip(a.parameters(), b.parameters())
    return all(
        torch.equal(opt_a.state[pa][k], opt_b.state[pb][k])
        for pa, pb in pairs for k in ("exp_avg", "exp_avg_sq", "step"))


@needs_torch
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_training_state_of_a_compiled_model(tmp_path: Path, suffix: str) -> None:
    model, compiled, opt = _trained(0)
    path = tmp_path / f"t{suffix}"
    ls.save_training(path, model=compiled, optimizer=opt, step=2)
    assert not any("_orig_mod" in n for n in ls.open(path).layout.names())
    eager = _net(1)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    assert ls.load_training(path, model=eager, optimizer=eager_opt).step == 2
    assert _same(eager, model) and _same_moments(opt, model, eager_opt, eager)


@needs_torch
def test_training_checkpoints_saved_with_orig_mod_names_still_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, compiled, opt = _trained(0)
    path = tmp_path / "old.h5"
    with monkeypatch.context() as m:  # what lean_store stored before
        m.setattr("lean_store.sources.torch_source.canonical_state", lambda state: state)
        m.setattr("lean_store.sources.optimizer.canonical_names", lambda names: list(names))
        ls.save_training(path, model=compiled, optimizer=opt, step=2)
    assert "model/_orig_mod.0.weight" in ls.open(path).layout.names()
    for wrap in (torch.compile, lambda module: module):
        fresh = _net(1)
        target = wrap(fresh)
        fresh_opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
        ls.load_training(path, model=target, optimizer=fresh_opt)
        assert _same(fresh, model) and _same_moments(opt, model, fresh_opt, fresh)
    assert np.array_equal(ls.load_state(path)["model/_orig_mod.0.weight"],
                          model[0].weight.detach().numpy())


@needs_torch
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_data_parallel_model(tmp_path: Path, suffix: str) -> None:
    model = _net(0)
    wrapped = torch.nn.DataParallel(model)
    assert next(iter(wrapped.state_dict())).startswith("module.")
    path = tmp_path / f"c{suffix}"
    ls.save(wrapped, path)
    assert ls.open(path).layout.names() == list(model.state_dict())
    for target in (_net(1), torch.nn.DataParallel(_net(2))):
        ls.load(target, path)
        assert _same(getattr(target, "module", target), model)
    old = tmp_path / f"old{suffix}"
    ls.save(dict(wrapped.state_dict()), old)  # the names lean_store stored before
    for target in (_net(3), torch.nn.DataParallel(_net(4))):
        ls.load(target, old)
        assert _same(getattr(target, "module", target), model)
    own = torch.nn.Module()  # a submodule of one's own called "module" keeps its name
    own.module = torch.nn.Linear(2, 2)
    ls.save(own, tmp_path / f"own{suffix}")
    assert ls.open(tmp_path / f"own{suffix}").layout.names() == ["module.weight", "module.bias"]


DDP_SCRIPT = """
import os, sys, torch, torch.distributed as dist, lean_store as ls
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0,
                        world_size=1)
def net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
model = net(0)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
ddp(torch.randn(3, 4)).sum().backward()
opt.step()
path = os.path.join(sys.argv[1], "t.h5")
ls.save_training(path, model=ddp, optimizer=opt, step=3)
print(ls.open(path).layout.names()[:2])
plain = net(1)
plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
ls.load_training(path, model=plain, optimizer=plain_opt)
print(all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters())),
      all(torch.equal(plain_opt.state[a]["exp_avg"], opt.state[b]["exp_avg"])
          for a, b in zip(plain.parameters(), model.parameters())))
again = torch.nn.parallel.DistributedDataParallel(net(2))
ls.save(ddp, os.path.join(sys.argv[1], "m.h5"))
ls.load(again, os.path.join(sys.argv[1], "m.h5"))
print(all(torch.equal(a, b) for a, b in zip(again.module.parameters(), model.parameters())))
dist.destroy_process_group()
"""


@needs_torch
def test_a_distributed_data_parallel_model(tmp_path: Path) -> None:
    from gloo_world import free_port

    run = subprocess.run([sys.executable, "-c", DDP_SCRIPT, str(tmp_path), str(free_port())],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == ["['model/0.weight', 'model/0.bias']", "True True", "True"]


def test_a_state_dict_target_keeps_its_names(tmp_path: Path) -> None:
    """Only a module's names are matched to a wrapper's spelling: a mapping is taken as is."""
    path = tmp_path / "c.h5"
    ls.save({"module.w": np.ones(3, np.float32), "_orig_mod.v": np.zeros(2)}, path)
    with pytest.raises(ls.LayoutError):
        ls.load({"w": np.empty(3, np.float32), "v": np.empty(2)}, path)
    with pytest.raises(ls.LayoutError):
        ls.load_state(path, like={"w": np.empty(3, np.float32), "v": np.empty(2)})


@needs_torch
def test_a_state_dict_given_as_the_training_model_keeps_its_names(tmp_path: Path) -> None:
    path = tmp_path / "t.h5"
    ls.save_training(path, model={"module.w": torch.ones(3)}, rng=False)
    with pytest.raises(ls.LayoutError, match="model/module.w"):
        ls.load_training(path, model={"w": torch.zeros(3)}, rng=False)
