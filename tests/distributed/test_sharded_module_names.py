"""Sharded saves and loads of wrapped modules (tests/training/test_module_names.py for one
process): an FSDP2 model wrapped by ``torch.compile`` is stored without ``_orig_mod``, and
sharded checkpoints saved with those names (before) load into the model compiled or not, model
and AdamW moments exact. One gloo rank in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch_optional import require_torch

require_torch()  # the child runs torch.distributed

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, os, sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import lean_store as ls
import lean_store.distributed.local_state as local_state
import lean_store.sources.optimizer as optimizer_names
import lean_store.sources.torch_source as torch_source

dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1])
root, suffix = sys.argv[2], sys.argv[3]

def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    fully_shard(model)
    return model

def step(model, opt):  # through the module itself: no compilation needed
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()

def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t

def same(a, b):
    return all(torch.equal(full(x), full(y)) for x, y in zip(a.parameters(), b.parameters()))

def same_moments(oa, a, ob, b):
    return all(torch.equal(full(oa.state[x][k]), full(ob.state[y][k]))
               for x, y in zip(a.parameters(), b.parameters()) for k in ("exp_avg", "exp_avg_sq"))

model = build(0)
compiled = torch.compile(model)
opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
step(model, opt)
out = {}
for old in (False, True):
    if old:  # what lean_store stored before: the names as the wrapper gives them
        kept = (torch_source.canonical_state, optimizer_names.canonical_names,
                local_state.canonical_state)
        torch_source.canonical_state = local_state.canonical_state = lambda state: state
        optimizer_names.canonical_names = lambda names: list(names)
    training = os.path.join(root, f"t{old}{suffix}")
    ls.save_training(training, model=compiled, optimizer=opt, step=1, rng=False)
    plain = os.path.join(root, f"m{old}{suffix}")
    ls.save(compiled, plain)
    if old:
        (torch_source.canonical_state, optimizer_names.canonical_names,
         local_state.canonical_state) = kept
    got = {"names": [ls.open(training).layout.names()[0], ls.open(plain).layout.names()[0]]}
    for wrap in ("compiled", "plain"):
        fresh = build(1)
        target = torch.compile(fresh) if wrap == "compiled" else fresh
        fresh_opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
        step(fresh, fresh_opt)
        ls.load_training(training, model=target, optimizer=fresh_opt, rng=False)
        trained = [same(fresh, model), same_moments(fresh_opt, fresh, opt, model)]
        other = build(2)
        ls.load(torch.compile(other) if wrap == "compiled" else other, plain)
        got[wrap] = trained + [same(other, model)]
    out[str(old)] = got
dist.destroy_process_group()
print(json.dumps(out))
sys.stdout.flush()
os._exit(0)  # why: tests/gloo_world.py leave_world
"""


@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_sharded_wrapped_modules(tmp_path: Path, suffix: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "rendezvous"), str(tmp_path), suffix],
        env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["False"]["names"] == ["model/0.weight", "0.weight"]
    assert got["True"]["names"] == ["model/_orig_mod.0.weight", "_orig_mod.0.weight"]
    for old in ("False", "True"):
        assert got[old]["compiled"] == [True, True, True], old
        assert got[old]["plain"] == [True, True, True], old
