"""No pickle, ever: not in any save/load/training path, not in the source tree."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np
import pytest
from torch_optional import require_torch

import lean_store as ls

torch = require_torch()

SOURCE = Path(ls.__file__).resolve().parent


def _forbidden(*args, **kwargs):
    raise AssertionError("pickle was called")


class _NoUnpickler(pickle.Unpickler):
    def __init__(self, *args, **kwargs):
        raise AssertionError("pickle.Unpickler was used")


class _NoPickler(pickle.Pickler):
    def __init__(self, *args, **kwargs):
        raise AssertionError("pickle.Pickler was used")


def _forbid_pickle(monkeypatch) -> None:
    for name in ("load", "loads", "dump", "dumps"):
        monkeypatch.setattr(pickle, name, _forbidden)
    for name in ("Unpickler", "_Unpickler"):
        monkeypatch.setattr(pickle, name, _NoUnpickler)
    for name in ("Pickler", "_Pickler"):
        monkeypatch.setattr(pickle, name, _NoPickler)
    _forbid_torch_load(monkeypatch)


def _forbid_torch_load(monkeypatch) -> None:
    real_load = torch.load

    def guarded_load(*args, **kwargs):
        if kwargs.get("weights_only") is not True:
            raise AssertionError("torch.load without weights_only=True")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", guarded_load)
    monkeypatch.setattr(torch, "save", _forbidden)
    monkeypatch.setattr(np, "load", _forbidden)


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_full_training_cycle_never_pickles(tmp_path, monkeypatch, suffix):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()
    _forbid_pickle(monkeypatch)  # from here on: every save, load, verify and partial read
    ls.save(model, tmp_path / f"m{suffix}")
    ls.save_training(tmp_path / f"t{suffix}", model=model, optimizer=opt, scheduler=sched, step=3)
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2)
    ls.load(model2, tmp_path / f"m{suffix}")
    ls.load_training(tmp_path / f"t{suffix}", model=model2, optimizer=opt2, scheduler=sched2)
    state = ls.load_state(tmp_path / f"m{suffix}")
    with ls.open(tmp_path / f"m{suffix}") as ck:
        ck.verify()
        first = next(iter(ck))
        ck[first][:1]
    assert ls.verify(tmp_path / f"t{suffix}").ok
    for name, value in model.state_dict().items():
        assert torch.equal(model2.state_dict()[name], value)
        assert np.asarray(state[name]).tobytes() == value.numpy().tobytes()


def test_source_tree_has_no_pickle():
    bad = []
    patterns = [
        (re.compile(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle|shelve|marshal)\b"), "import"),
        (re.compile(r"\b(c?pickle|dill|cloudpickle|marshal)\.(loads?|dumps?|Unpickler)\b"), "call"),
        (re.compile(r"allow_pickle\s*=\s*True"), "allow_pickle=True"),
    ]
    for file in sorted(SOURCE.rglob("*.py")):
        for n, line in enumerate(file.read_text().splitlines(), 1):
            for pattern, what in patterns:
                if pattern.search(line):
                    bad.append(f"{file.relative_to(SOURCE)}:{n}: {what}: {line.strip()}")
            call = re.search(r"\btorch\.load\((.*)", line)
            if call and "weights_only=True" not in line:
                bad.append(f"{file.relative_to(SOURCE)}:{n}: torch.load without weights_only")
            if re.search(r"\bnp\.load\(", line) and "allow_pickle=False" not in line:
                bad.append(f"{file.relative_to(SOURCE)}:{n}: np.load without allow_pickle=False")
    assert bad == []
