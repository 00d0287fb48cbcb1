"""Sharded training checkpoints (``ls.save_training`` / ``ls.load_training`` with DTensor models)
across real processes: torch.distributed with gloo on loopback, harness of test_distributed.

World ``save4`` (4 ranks) trains one exact AdamW step plus a StepLR step, saves with
``save_training`` (Zarr and HDF5), then trains on as the uninterrupted run. World ``cont4``
(4 fresh ranks) restores and trains on: parameters, moments and every rank's RNG draws must
match the uninterrupted run; a hyperparameter mismatch, on every rank or on one rank only, is
rejected on every rank with nothing installed. World ``load2`` (2 ranks, other placements)
and the test process itself (1 process) reload the checkpoint bit-identically to an unsharded
reference, and warn that RNG continuation cannot be reproduced.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from test_distributed import batch, local_equal, make_model, outcome, placements_for, run_world
from torch_optional import require_torch

require_torch()  # every test here runs torch.distributed

HERE = Path(__file__).resolve()
MORE = 2  # steps after the checkpoint
LR, GAMMA, WD = 1e-2, 0.5, 0.1


def optimizer_for(model, *, betas=(0.9, 0.999), weight_decay=WD):
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=betas, weight_decay=weight_decay)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)


def dtensor_model(mesh, shard_dim: int, zeros: bool):
    """make_model() with weights Shard(shard_dim), first bias Shard(0), last bias replicated;
    zeros=True for a fresh model to load into."""
    import torch
    from torch.distributed.tensor import distribute_tensor

    model = make_model()
    for index, mod in enumerate(model):
        for pname, param in list(mod.named_parameters(recurse=False)):
            full = torch.zeros_like(param) if zeros else param.detach()
            dt = distribute_tensor(full, mesh, placements_for(f"{index}.{pname}", shard_dim))
            setattr(mod, pname, torch.nn.Parameter(dt))
    return model


def train(model, opt, sched, mesh, steps: int, first_fixed: bool) -> None:
    """AdamW steps on a replicated batch; after the first, batches come from the torch RNG
    (rank 0's draw is broadcast), so a continuation depends on the restored RNG."""
    import torch
    from torch.distributed.tensor import Replicate, distribute_tensor

    for i in range(steps):
        xb = batch() if (first_fixed and i == 0) else torch.randint(-4, 5, (6, 8)).double()
        x = distribute_tensor(xb, mesh, [Replicate()]) if mesh is not None else xb
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
        sched.step()


def seed_rank(rank: int) -> None:
    import torch

    torch.manual_seed(1000 + rank)
    np.random.seed(2000 + rank)
    random.seed(3000 + rank)


def draws() -> list:
    """The next values of every global RNG of this rank."""
    import torch

    return [torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random()]]


def full_state(model, opt) -> dict[str, np.ndarray]:
    """Parameters and optimizer moments as whole tensors (a collective for DTensors)."""
    from lean_store.distributed import training_state

    out = {}
    for k, v in training_state(model, opt).items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = v.detach().numpy().copy()
    return out


def hyper(opt) -> list:
    """Param-group hyperparameters, as plain JSON (floats exact), for comparison."""
    groups = [{k: v for k, v in g.items() if k != "params"}
              for g in opt.state_dict()["param_groups"]]
    return json.loads(json.dumps(groups))


def reference():
    """The unsharded run: one AdamW + StepLR step in one process."""
    model = make_model()
    opt, sched = optimizer_for(model)
    train(model, opt, sched, None, 1, first_fixed=True)
    return model, opt, sched


# ------------------------------------------------------------------------- scenarios


def trained_scaler():
    """A mixed-precision loss scaler after some steps: backed off once, grown since."""
    import torch

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=3)
    scaler.load_state_dict({"scale": 2.0 ** 14 / 3, "growth_factor": 2.0,
                            "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": 2})
    return scaler


def scenario_save4(rank: int, world: int, out: Path) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh

    import lean_store as ls

    mesh = DeviceMesh("cpu", list(range(world)))
    model = dtensor_model(mesh, 0, zeros=False)
    opt, sched = optimizer_for(model)
    seed_rank(rank)
    train(model, opt, sched, mesh, 1, first_fixed=True)
    saved = full_state(model, opt)
    rec: dict = {"hyper": hyper(opt)}
    # ranks disagreeing on the step: refused on every rank, nothing written
    rec["step_mismatch"] = outcome(lambda: ls.save_training(
        out / "bad.zarr", model=model, optimizer=opt, step=1 + (rank == 3)))
    for name in ("tr.zarr", "tr.h5"):
        ls.save_training(out / name, model=model, optimizer=opt, scheduler=sched, step=1,
                         extra={"note": "sharded"}, process_group=dist.group.WORLD,
                         scaler=trained_scaler())
    run = ls.Checkpointer(out / "run", keep_last=2, backend="hdf5",
                          process_group=dist.group.WORLD)
    for step in (1, 2, 3):
        run.save(step, model=model, optimizer=opt, scheduler=sched)
    rec["run_steps"] = run.steps()
    # the uninterrupted run goes on from the RNG states as saved: draws, then batches
    rec["draws"] = draws()
    train(model, opt, sched, mesh, MORE, first_fixed=False)
    final = full_state(model, opt)
    if rank == 0:
        np.savez(out / "saved.npz", **{k.replace(".", "__"): v for k, v in saved.items()})
        np.savez(out / "uninterrupted.npz", **{k.replace(".", "__"): v for k, v in final.items()})
    return rec


def scenario_cont4(rank: int, world: int, out: Path) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh

    import lean_store as ls
    from lean_store.distributed import training_state
    from lean_store.distributed.training import load_training as sharded_load_training
    from lean_store.training.state import SCHEDULED

    mesh = DeviceMesh("cpu", list(range(world)))
    rec: dict = {}
    # rejections first: betas on every rank; weight decay on rank 1 only
    for case, kwargs in (("betas", {"betas": (0.8, 0.999)}),
                         ("one_rank", {"weight_decay": 0.2 if rank == 1 else WD})):
        model = dtensor_model(mesh, 0, zeros=True)
        opt, sched = optimizer_for(model, **kwargs)
        before = full_state(model, opt), hyper(opt), sched.state_dict()
        rec[case] = outcome(lambda m=model, o=opt, s=sched: ls.load_training(
            out / "tr.zarr", model=m, optimizer=o, scheduler=s))
        after = full_state(model, opt), hyper(opt), sched.state_dict()
        rec[case]["unchanged"] = (
            all(before[0][k].tobytes() == after[0][k].tobytes() for k in before[0])
            and not opt.state and before[1] == after[1] and before[2] == after[2])
    # the last model tensor's one chunk file truncated: a load without verify fails on every
    # rank before anything is installed (its length is checked by check_metadata, not on open)
    if rank == 0:
        shutil.copytree(out / "tr.zarr", out / "short.zarr")
        root = json.loads((out / "short.zarr" / "zarr.json").read_text())
        node = next(n for n, d in root["consolidated_metadata"]["metadata"].items()
                    if d["attributes"]["name"] == "model/1.bias")
        chunk = out / "short.zarr" / node / "c.0"
        chunk.write_bytes(chunk.read_bytes()[:-2])
    dist.barrier()
    model = dtensor_model(mesh, 0, zeros=True)
    opt, sched = optimizer_for(model)
    before = full_state(model, opt)
    rec["short_no_verify"] = outcome(lambda: sharded_load_training(  # verify=False: internal
        out / "short.zarr", process_group=dist.group.WORLD, model=model, names_model=model,
        optimizer=opt, scheduler=sched, scheduled=SCHEDULED, verify=False))
    after = full_state(model, opt)
    rec["short_no_verify"]["unchanged"] = not opt.state and all(
        before[k].tobytes() == after[k].tobytes() for k in before)
    # a Checkpointer of sharded steps: rank 0 picks the latest, every rank restores it
    saved = {k.replace("__", "."): v for k, v in np.load(out / "saved.npz").items()}
    model = dtensor_model(mesh, 0, zeros=True)
    opt, sched = optimizer_for(model)
    info = ls.Checkpointer(out / "run", process_group=dist.group.WORLD).restore(
        model=model, optimizer=opt, scheduler=sched)
    rec["run_restore"] = {"step": info.step, "equal": all(
        local_equal(v, saved[k]) for k, v in training_state(model, opt).items())}
    # restore into fresh ranks, same world size, and train on
    seed_rank(rank + 77)  # anything else: the restore must bring back this rank's own state
    model = dtensor_model(mesh, 0, zeros=True)
    opt, sched = optimizer_for(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = ls.load_training(out / "tr.h5", model=model, optimizer=opt, scheduler=sched)
    rec.update(step=info.step, extra=info.extra, rng_restored=info.rng_restored,
               warnings=[str(w.message) for w in caught], draws=draws(), hyper=hyper(opt))
    train(model, opt, sched, mesh, MORE, first_fixed=False)
    final = full_state(model, opt)
    if rank == 0:
        np.savez(out / "continued.npz", **{k.replace(".", "__"): v for k, v in final.items()})
    return rec


def scenario_load2(rank: int, world: int, out: Path) -> dict:
    """2 ranks, weights on Shard(1): parameters and moments equal the saved state."""
    import torch
    from torch.distributed.tensor import DeviceMesh

    import lean_store as ls
    from lean_store.distributed import init_optimizer_state, training_state

    saved = {k.replace("__", "."): v for k, v in np.load(out / "saved.npz").items()}
    mesh = DeviceMesh("cpu", list(range(world)))
    rec: dict = {}
    for name, fresh in (("tr.zarr", True), ("tr.h5", False)):
        model = dtensor_model(mesh, 1, zeros=True)
        opt, sched = optimizer_for(model)
        if not fresh:
            init_optimizer_state(opt)  # live state: loaded into its placements
        scaler = torch.amp.GradScaler("cpu")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            info = ls.load_training(out / name, model=model, optimizer=opt, scheduler=sched,
                                    scaler=scaler)
        state = training_state(model, opt)
        rec[name] = {
            "equal": {k: local_equal(v, saved[k]) for k, v in state.items()},
            "placements": sorted({str(v.placements) for v in state.values()
                                  if hasattr(v, "placements")}),
            "step": info.step, "rng_restored": info.rng_restored, "hyper": hyper(opt),
            "last_epoch": sched.last_epoch, "warnings": [str(w.message) for w in caught],
            "scaler": scaler.state_dict(),
        }
    return rec


SCENARIOS = {"save4": scenario_save4, "cont4": scenario_cont4, "load2": scenario_load2}


# ------------------------------------------------------------------------- tests


def _npz(path: Path) -> dict[str, np.ndarray]:
    return {k.replace("__", "."): v for k, v in np.load(path).items()}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded_training")
    saved = run_world("save4", 4, out, script=HERE)
    cont = run_world("cont4", 4, out, script=HERE)
    loaded = run_world("load2", 2, out, script=HERE)
    return out, saved, cont, loaded


def test_sharded_save_matches_the_unsharded_reference(worlds):
    out, saved, _cont, _loaded = worlds
    from lean_store.distributed import training_state

    model, opt, _sched = reference()
    ref = {k: v.detach().numpy() for k, v in training_state(model, opt).items()}
    run = _npz(out / "saved.npz")
    assert set(run) == set(ref) and any(k.endswith("exp_avg_sq") for k in ref)
    for k in ref:
        assert run[k].tobytes() == ref[k].tobytes(), k
    assert all(rec["hyper"] == hyper(opt) for rec in saved)


def test_metadata_written_once_with_names_and_one_rng_record_per_rank(worlds):
    import lean_store as ls
    from lean_store.training.state import read_metadata

    out, _saved, _cont, _loaded = worlds
    for name in ("tr.zarr", "tr.h5"):
        with ls.open(out / name) as ck:
            assert ck.kind == "training"
            _version, meta, _prefix = read_metadata(ck)
            opt = meta["optimizer"]
            assert opt["class"] == "torch.optim.adamw.AdamW"
            assert opt["groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
            assert meta["step"] == 1 and meta["scheduler"]["state"]["last_epoch"] == 1
            assert len(meta["rng"]["ranks"]) == 4
            assert ck["rng/torch_cpu"].shape[0] == 4
            rows = ck["rng/torch_cpu"].read()
            assert len({rows[r].tobytes() for r in range(4)}) == 4  # every rank its own
            assert {s.rank for s in ck._shards["rng/torch_cpu"]} == {0, 1, 2, 3}
            assert [s.rank for s in ck._shards["model/0.weight"]] == [0, 1, 2, 3]
            assert [s.rank for s in ck._shards["optimizer/state/0.weight/exp_avg"]] == [0, 1, 2, 3]
            assert len(ck._shards["optimizer/state/0.weight/step"]) == 1
        assert ls.verify(out / name).ok


def test_ranks_with_different_metadata_are_refused_on_every_rank(worlds):
    out, saved, _cont, _loaded = worlds
    errs = [rec["step_mismatch"] for rec in saved]
    assert len({json.dumps(e) for e in errs}) == 1, errs
    assert errs[0]["type"] == "CheckpointError" and "ranks [3]" in errs[0]["message"]
    assert "/step" in errs[0]["message"]
    assert not (out / "bad.zarr").exists()


def test_restore_on_the_same_world_size_continues_exactly(worlds):
    out, saved, cont, _loaded = worlds
    a, b = _npz(out / "uninterrupted.npz"), _npz(out / "continued.npz")
    assert set(a) == set(b)
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), k
    for rank, (s, c) in enumerate(zip(saved, cont)):
        assert c["draws"] == s["draws"], rank  # each rank's own torch/numpy/python RNG
        assert c["rng_restored"] and not c["warnings"] and c["step"] == 1
        assert c["extra"] == {"note": "sharded"} and c["hyper"] == s["hyper"]
    assert len({json.dumps(c["draws"]) for c in cont}) == 4


def test_checkpointer_saves_and_restores_sharded_steps(worlds):
    out, saved, cont, _loaded = worlds
    assert all(rec["run_steps"] == [2, 3] for rec in saved)
    names = sorted(p.name for p in (out / "run").iterdir())
    assert names == ["step_0000000002.h5", "step_0000000003.h5"]  # pruned, no leftovers
    assert (out / "run" / names[-1] / "lean_store.h5").is_file()  # a sharded HDF5 directory
    assert all(rec["run_restore"] == {"step": 3, "equal": True} for rec in cont)


@pytest.mark.parametrize("case,words", [
    ("betas", "group 0 betas"), ("one_rank", "rank 1 of 4"),
])
def test_hyperparameter_mismatch_is_rejected_on_every_rank_nothing_installed(worlds, case,
                                                                             words):
    _out, _saved, cont, _loaded = worlds
    errs = [rec[case] for rec in cont]
    assert len({(e["type"], e["message"]) for e in errs}) == 1, errs
    assert errs[0]["type"] == "LayoutError" and words in errs[0]["message"]
    if case == "one_rank":
        assert "weight_decay" in errs[0]["message"]
    assert all(e["unchanged"] for e in errs)


def test_truncated_last_tensor_fails_a_load_without_verify_on_every_rank_nothing_installed(
        worlds):
    _out, _saved, cont, _loaded = worlds
    errs = [rec["short_no_verify"] for rec in cont]
    assert len({(e["type"], e["message"]) for e in errs}) == 1, errs
    assert errs[0]["type"] == "IntegrityError" and "c.0" in errs[0]["message"], errs[0]
    assert all(e["unchanged"] for e in errs)


def test_four_ranks_reshard_into_two_ranks(worlds):
    _out, saved, _cont, loaded = worlds
    for rec in loaded:
        for name in ("tr.zarr", "tr.h5"):
            r = rec[name]
            assert r["equal"] and all(r["equal"].values()), r["equal"]
            assert "(Shard(dim=1),)" in r["placements"]
            assert r["step"] == 1 and r["last_epoch"] == 1 and r["hyper"] == saved[0]["hyper"]
            assert not r["rng_restored"]
            assert any("saved by 4 ranks, loading on 2" in w for w in r["warnings"])
            assert r["scaler"] == trained_scaler().state_dict()  # the loss scaler too


@pytest.mark.parametrize("name", ["tr.zarr", "tr.h5"])
def test_one_process_loads_the_sharded_training_checkpoint(worlds, name):
    import torch

    import lean_store as ls
    from lean_store.distributed import training_state

    out, _saved, _cont, _loaded = worlds
    ref_model, ref_opt, ref_sched = reference()
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt, sched = optimizer_for(model)
    with pytest.warns(UserWarning, match="saved by 4 ranks, loading on 1"):
        info = ls.load_training(out / name, model=model, optimizer=opt, scheduler=sched)
    assert info.step == 1 and info.extra == {"note": "sharded"} and not info.rng_restored
    ref = training_state(ref_model, ref_opt)
    got = training_state(model, opt)
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].detach().numpy().tobytes() == ref[k].detach().numpy().tobytes(), k
    assert hyper(opt) == hyper(ref_opt) and sched.state_dict() == ref_sched.state_dict()


if __name__ == "__main__":
    from test_distributed import worker

    _scenario, _rank, _world, _port, _out = sys.argv[1:6]
    worker(_scenario, int(_rank), int(_world), int(_port), Path(_out), SCENARIOS)
