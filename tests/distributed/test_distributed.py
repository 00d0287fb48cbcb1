"""Sharded checkpoints across real processes: torch.distributed with gloo on loopback.

Each world runs this file as a script, one process per rank (``python test_distributed.py
SCENARIO RANK WORLD PORT DIR``); ranks record what they saw in ``DIR/<scenario>-<rank>.json``
and the tests assert on those records and on the files left behind. Every process has a
timeout, so a broken collective fails a test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import gloo_world
import numpy as np
import pytest
from torch_optional import require_torch

require_torch()  # every test here runs torch.distributed

HERE = Path(__file__).resolve()
WORLD_TIMEOUT = 120
STEPS = 1  # one exact step; later steps would round sums in a different order


# ------------------------------------------------------------------------- the model


def make_model():
    """Two float64 linear layers with dyadic weights and integer inputs: every sum in the
    forward and backward pass is exact, so a sharded run (whose matmuls are split and
    reduced in another order) computes bit-identical gradients and AdamW moments."""
    import torch

    g = torch.Generator().manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Linear(12, 4)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-8, 9, p.shape, generator=g).double() / 8)
    return model


def batch():
    import torch

    g = torch.Generator().manual_seed(99)
    return torch.randint(-4, 5, (6, 8), generator=g).double()


def reference_state() -> dict[str, np.ndarray]:
    """The unsharded run: STEPS AdamW steps in one process; params and moments by name."""
    import torch

    from lean_store.distributed import training_state

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = batch()
    for _ in range(STEPS):
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in training_state(model, opt).items()}


def placements_for(name: str, shard_dim: int):
    """Weights and first bias sharded; the last bias replicated (written once by rank 0)."""
    from torch.distributed.tensor import Replicate, Shard

    if name.endswith("1.bias"):
        return [Replicate()]
    if name.endswith("bias"):
        return [Shard(0)]
    return [Shard(shard_dim)]


def sharded_model(mesh, shard_dim: int, train: bool):
    import torch
    from torch.distributed.tensor import Replicate, distribute_tensor

    from lean_store.distributed import init_optimizer_state

    model = make_model()
    for mod in model:
        for pname, param in list(mod.named_parameters(recurse=False)):
            full = param.detach() if train else torch.zeros_like(param)
            name = f"{pname}" if not hasattr(mod, "weight") else pname
            dt = distribute_tensor(full, mesh, placements_for(
                f"{list(model).index(mod)}.{name}", shard_dim))
            setattr(mod, pname, torch.nn.Parameter(dt))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if train:
        x = distribute_tensor(batch(), mesh, [Replicate()])
        for _ in range(STEPS):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    else:
        init_optimizer_state(opt)
    return model, opt


def local_equal(value, ref: np.ndarray) -> bool:
    """This rank's piece of ``value`` equals the same region of ``ref``, bit for bit."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(value, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements)
        region = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        local = value.to_local().detach().numpy()
        return local.tobytes() == np.ascontiguousarray(ref[region]).tobytes()
    return value.detach().numpy().tobytes() == ref.tobytes()


def outcome(fn) -> dict:
    """Run ``fn``; the error it raised (type and message) or None."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - recorded for the test to assert on
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": None}


def damaged_loads(state_of, rows, out: Path, names) -> dict:
    """Each checkpoint of ``names`` in ``out`` loaded with and without verify into a target
    ``state_of(fill=-1.0)``: the outcome, and whether every tensor of ``rows`` stayed
    untouched, by ``"<name> verify=<bool>"``."""
    import lean_store as ls

    rec = {}
    for name in names:
        for verify in (True, False):
            target = state_of(fill=-1.0)
            got = outcome(lambda t=target, n=name, v=verify: ls.load(t, out / n, verify=v))
            got["unchanged"] = all(bool((target[k].tensor == -1.0).all()) for k in rows)
            rec[f"{name} verify={verify}"] = got
    return rec


# ------------------------------------------------------------------------- scenarios


def scenario_save4(rank: int, world: int, out: Path) -> dict:
    """4 ranks train a Shard(0) model with AdamW, then save it to Zarr, HDF5 and file://."""
    import torch
    from torch.distributed.tensor import DeviceMesh

    import lean_store as ls
    from lean_store.distributed import LocalShard, training_state
    from lean_store.stores import sharded_layout

    mesh = DeviceMesh("cpu", list(range(world)))
    model, opt = sharded_model(mesh, 0, train=True)
    state = training_state(model, opt)
    if rank == 0:
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().numpy()
                for k, v in state.items()}
    else:
        full = {k: v.full_tensor() for k, v in state.items() if hasattr(v, "full_tensor")}
    ls.save(state, out / "ck.zarr")
    ls.save(state, out / "ck.h5")
    ls.save(state, "file://" + str(out / "url.zarr"))
    if rank == 0:
        np.savez(out / "sharded_run.npz", **{k.replace(".", "__"): v for k, v in full.items()})
    rec: dict = {}
    # a different model, for the rejection tests
    other = {"0.weight": LocalShard(torch.ones(3, 5), (3 * world, 5), (3 * rank, 0))}
    ls.save(other, out / "other.zarr")
    # user shard specs that overlap: rejected at save on every rank, nothing written
    bad = {"w": LocalShard(torch.ones(3), (2 * world + 1,), (2 * rank,))}
    rec["overlap_save"] = outcome(lambda: ls.save(bad, out / "bad.zarr"))
    # uneven user shards (boundaries 5 and 7 of 40000) that cannot align to useful zarr
    # chunks: written in turns, still exact
    bounds = [0, 5, 7, 20000, 40000]
    data = torch.arange(40000, dtype=torch.int32)
    lo, hi = bounds[rank], bounds[rank + 1]
    ls.save({"v": LocalShard(data[lo:hi].clone(), (40000,), (lo,))}, out / "uneven.zarr")
    # one rank fails mid-write: every rank raises, the previous checkpoint stays
    real = sharded_layout.write_box

    def failing(piece, box, unit, write):
        if rank == 2:
            raise OSError("disk full (injected)")
        return real(piece, box, unit, write)

    sharded_layout.write_box = failing
    for name in ("ck.zarr", "ck.h5"):
        rec[f"fail_{name}"] = outcome(lambda name=name: ls.save(state, out / name))
    sharded_layout.write_box = real
    return rec


def scenario_load2(rank: int, world: int, out: Path) -> dict:
    """2 ranks load the 4-rank checkpoints with Shard(1) placements; rejections."""
    from torch.distributed.tensor import DeviceMesh

    import lean_store as ls
    from lean_store.distributed import training_state
    from lean_store.stores.base import StoreReader

    ref = {k.replace("__", "."): v for k, v in np.load(out / "sharded_run.npz").items()}
    mesh = DeviceMesh("cpu", list(range(world)))
    rec: dict = {"equal": {}}
    for name in ("ck.zarr", "ck.h5", "file://" + str(out / "url.zarr")):
        model, opt = sharded_model(mesh, 1, train=False)
        state = training_state(model, opt)
        ls.load(state, name if "://" in name else out / name)
        rec["equal"][Path(name).name] = all(local_equal(v, ref[k]) for k, v in state.items())
    # reads touch only this rank's boxes (no verification pass, which reads whole shards)
    model, opt = sharded_model(mesh, 1, train=False)
    state = training_state(model, opt)
    from lean_store.distributed.local_state import local_pieces

    boxes = {p.name: p.box for p in local_pieces(state)}
    reads: list = []
    from lean_store.stores.zarr.store import ZarrReader

    real_read = ZarrReader.read

    def spy(self, node, selection, fmt, out=None):
        reads.append((node, selection.start, selection.count))
        return real_read(self, node, selection, fmt, out)

    ZarrReader.read = spy
    try:
        ls.load(state, out / "ck.zarr", verify=False)
    finally:
        ZarrReader.read = real_read
    from lean_store.naming import node_name

    by_node = {node_name(n): b for n, b in boxes.items()}
    rec["reads_inside_own_box"] = all(
        all(b.offsets[i] <= s and s + c <= b.ends[i] for i, (s, c) in enumerate(zip(st, ct)))
        for node, st, ct in reads for b in [by_node[node]]
    )
    rec["read_elements"] = sum(int(np.prod(c)) for _, _, c in reads)
    rec["own_elements"] = sum(b.size for b in boxes.values())
    assert StoreReader  # the reader protocol is what was spied on
    # rejections: every rank must raise the same error
    for name in ("overlap.zarr", "missing.zarr", "overlap.h5", "other.zarr", "corrupt.zarr"):
        model, opt = sharded_model(mesh, 1, train=False)
        state = training_state(model, opt)
        before = {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
                  for k, v in state.items()}
        rec[name] = outcome(lambda name=name, state=state: ls.load(state, out / name))
        after = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in state.items()}
        rec[name]["unchanged"] = all(before[k].equal(after[k]) for k in before)
    return rec


def scenario_die(rank: int, world: int, out: Path) -> dict:
    """Rank 1 dies in the middle of writing its shards; rank 0 must raise, commit nothing."""
    import torch

    import lean_store as ls
    from lean_store.distributed import LocalShard
    from lean_store.stores import sharded_layout

    def state(value: float) -> dict:
        return {"w": LocalShard(torch.full((4, 3), value), (8, 3), (4 * rank, 0))}

    ls.save(state(1.0), out / "die.zarr")
    real = sharded_layout.write_box

    def dying(piece, box, unit, write):
        result = real(piece, box, unit, write)
        if rank == 1:
            os._exit(17)
        return result

    sharded_layout.write_box = dying
    return {"second_save": outcome(lambda: ls.save(state(2.0), out / "die.zarr"))}


SCENARIOS = {"save4": scenario_save4, "load2": scenario_load2, "die": scenario_die}


def worker(scenario: str, rank: int, world: int, port: int, out: Path,
           scenarios: dict | None = None) -> None:
    gloo_world.worker(scenarios or SCENARIOS, scenario, rank, world, port, out)


def run_world(scenario: str, world: int, out: Path, expect_rc: dict | None = None,
              script: Path = HERE) -> list[dict]:
    """Run ``script SCENARIO RANK WORLD PORT OUT`` as ``world`` ranks; their records."""
    return gloo_world.run_world(script, scenario, world, out, timeout=WORLD_TIMEOUT,
                                expect_rc=expect_rc)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """One 4-rank save world, tampered copies, then one 2-rank load world."""
    out = tmp_path_factory.mktemp("sharded")
    saved = run_world("save4", 4, out)
    _tamper(out)
    loaded = run_world("load2", 2, out)
    return out, saved, loaded


def _zarr_shards(path: Path, node: str) -> tuple[Path, dict]:
    meta_path = path / node / "zarr.json"
    return meta_path, json.loads(meta_path.read_text())


def _write_zarr_meta(meta_path: Path, meta: dict) -> None:
    """An array's altered zarr.json, and its copy in the root's consolidated metadata (which
    the reader describes the array from): a consistent edit."""
    meta_path.write_text(json.dumps(meta))
    root_path = meta_path.parent.parent / "zarr.json"
    root = json.loads(root_path.read_text())
    root["consolidated_metadata"]["metadata"][meta_path.parent.name] = meta
    root_path.write_text(json.dumps(root))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fixed(text: str) -> np.ndarray:
    """``text`` as a fixed-length UTF-8 string attribute, as lean_store writes strings."""
    import h5py

    data = text.encode()
    return np.array(data, dtype=h5py.string_dtype("utf-8", len(data)))


def _tamper(out: Path) -> None:
    import shutil

    import h5py

    for name, how in (("overlap.zarr", "overlap"), ("missing.zarr", "missing")):
        shutil.copytree(out / "ck.zarr", out / name)
        meta_path, meta = _zarr_shards(out / name, "0.weight")
        shards = json.loads(meta["attributes"]["shards"])
        if how == "overlap":
            shards[1]["offsets"][0] -= 1
        else:
            del shards[2]
        meta["attributes"]["shards"] = json.dumps(shards)
        _write_zarr_meta(meta_path, meta)
    shutil.copytree(out / "ck.h5", out / "overlap.h5")
    with h5py.File(out / "overlap.h5" / "lean_store.h5", "r+") as f:
        shards = json.loads(f["0.weight"].attrs["shards"])
        shards[1]["offsets"][0] -= 1
        text = json.dumps(shards)
        f["0.weight"].attrs["shards"] = _fixed(text)
        # and its record in the master manifest (a consistent edit, as for Zarr above)
        manifest = json.loads(f.attrs["master_manifest"])
        (record,) = [r for r in manifest["tensors"] if r["node"] == "0.weight"]
        record["attrs"]["shards"] = text
        f.attrs["master_manifest"] = _fixed(json.dumps(manifest))
    shutil.copytree(out / "ck.zarr", out / "corrupt.zarr")
    _meta_path, meta = _zarr_shards(out / "corrupt.zarr", "0.weight")
    shards = json.loads(meta["attributes"]["shards"])
    _write_zarr_meta(_meta_path, meta)
    # flip the recorded digest of one shard: the data no longer matches it
    shards[3]["crc32c"] ^= 1
    meta["attributes"]["shards"] = json.dumps(shards)
    _write_zarr_meta(_meta_path, meta)


# ------------------------------------------------------------------------- tests


def test_sharded_training_matches_unsharded_reference(worlds):
    out, _saved, _loaded = worlds
    ref = reference_state()
    run = {k.replace("__", "."): v for k, v in np.load(out / "sharded_run.npz").items()}
    assert set(run) == set(ref) and any(k.endswith("exp_avg_sq") for k in ref)
    for name in ref:
        assert run[name].tobytes() == ref[name].tobytes(), name


def test_four_ranks_reshard_into_two_ranks_bit_exact(worlds):
    _out, _saved, loaded = worlds
    for rec in loaded:
        assert rec["equal"] == {"ck.zarr": True, "ck.h5": True, "url.zarr": True}


def test_each_rank_reads_only_its_own_regions(worlds):
    _out, _saved, loaded = worlds
    for rec in loaded:
        assert rec["reads_inside_own_box"]
        assert rec["read_elements"] == rec["own_elements"]


@pytest.mark.parametrize("name", ["ck.zarr", "ck.h5", "url.zarr"])
def test_single_process_load_and_open(worlds, name):
    import torch

    import lean_store as ls
    from lean_store.distributed import init_optimizer_state, training_state

    out, _saved, _loaded = worlds
    path = "file://" + str(out / name) if name == "url.zarr" else out / name
    ref = {k.replace("__", "."): v for k, v in np.load(out / "sharded_run.npz").items()}
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    init_optimizer_state(opt)
    state = training_state(model, opt)
    ls.load(state, path)
    for key, value in state.items():
        assert value.detach().numpy().tobytes() == ref[key].tobytes(), key
    with ls.open(path) as ck:
        ck.verify()
        w = ref["0.weight"]
        assert np.array_equal(ck["0.weight"][3:9:2, 1], w[3:9:2, 1])
        assert np.array_equal(ck["0.weight"][-1], w[-1])
        moment = "optim.1.weight.exp_avg"
        assert np.array_equal(np.asarray(ck[moment]), ref[moment])


def test_replicated_tensors_are_written_once_by_one_rank(worlds):
    import h5py

    out, _saved, _loaded = worlds
    writers = {}
    for node in ("1.bias", "optim.0.weight.step"):
        _p, meta = _zarr_shards(out / "ck.zarr", node)
        (shard,) = json.loads(meta["attributes"]["shards"])
        writers[node] = shard["rank"]
    assert writers["1.bias"] != 0  # replicas go to the least loaded ranks, not all to rank 0
    _p, meta = _zarr_shards(out / "ck.zarr", "0.weight")
    shards = json.loads(meta["attributes"]["shards"])
    assert [s["rank"] for s in shards] == [0, 1, 2, 3]
    assert [s["offsets"][0] for s in shards] == [0, 3, 6, 9]
    assert meta["chunk_grid"]["configuration"]["chunk_shape"][0] == 3  # aligned to shards
    with h5py.File(out / "ck.h5" / "lean_store.h5", "r") as f:
        records = {n: json.loads(f[n].attrs["shards"]) for n in ("1.bias",
                                                                 "optim.0.weight.step")}
    for node, (record,) in records.items():
        for rank in range(4):
            with h5py.File(out / "ck.h5" / f"shard-{rank:05d}-of-00004.h5", "r") as f:
                held = [n for n in f if _text(f[n].attrs["tensor"]) == node]
            assert len(held) == (rank == record["rank"]), (node, rank, held)


def test_h5py_alone_reads_whole_tensors_from_the_master_file(worlds, tmp_path):
    import shutil

    import h5py

    out, _saved, _loaded = worlds
    ref = {k.replace("__", "."): v for k, v in np.load(out / "sharded_run.npz").items()}
    moved = tmp_path / "moved.h5"
    shutil.copytree(out / "ck.h5", moved)  # relative sources: the directory can move
    with h5py.File(moved / "lean_store.h5", "r") as f:
        assert f["0.weight"].is_virtual
        assert np.array_equal(f["0.weight"][...], ref["0.weight"])
        assert np.array_equal(f["optim.0.weight.exp_avg_sq"][...],
                              ref["optim.0.weight.exp_avg_sq"])
        assert np.array_equal(f["0.weight"][4:7, 2], ref["0.weight"][4:7, 2])
    dump = subprocess.run(["h5dump", "-d", "/1.bias", str(moved / "lean_store.h5")],
                          capture_output=True, text=True, timeout=30)
    assert dump.returncode == 0 and "DATASPACE  SIMPLE { ( 4 ) / ( 4 ) }" in dump.stdout


def test_overlapping_save_is_rejected_on_every_rank(worlds):
    out, saved, _loaded = worlds
    errors = {json.dumps(rec["overlap_save"]) for rec in saved}
    assert len(errors) == 1
    (err,) = [rec["overlap_save"] for rec in saved[:1]]
    assert err["type"] == "CheckpointError" and "overlap" in err["message"]
    assert not (out / "bad.zarr").exists()


def test_misaligned_shards_are_written_in_turns_and_exact(worlds):
    import lean_store as ls

    out, _saved, _loaded = worlds
    with ls.open(out / "uneven.zarr") as ck:
        assert np.array_equal(ck["v"].read(), np.arange(40000, dtype=np.int32))
        assert len(ck._shards["v"]) == 4


def test_a_failing_rank_commits_nothing_and_every_rank_raises(worlds):
    import lean_store as ls

    out, saved, _loaded = worlds
    ref = {k.replace("__", "."): v for k, v in np.load(out / "sharded_run.npz").items()}
    for name in ("ck.zarr", "ck.h5"):
        errs = [rec[f"fail_{name}"] for rec in saved]
        assert len({json.dumps(e) for e in errs}) == 1, errs
        assert "rank 2 of 4" in errs[0]["message"] and "disk full" in errs[0]["message"]
        state = ls.load_state(out / name)  # the previous checkpoint, intact
        assert state["0.weight"].tobytes() == ref["0.weight"].tobytes()
    assert not [p for p in out.iterdir() if "lean_store-tmp" in p.name]


@pytest.mark.parametrize("name,kind,words", [
    ("overlap.zarr", "IntegrityError", "overlap"),
    ("missing.zarr", "IntegrityError", "missing"),
    ("overlap.h5", "IntegrityError", "overlap"),
    ("other.zarr", "LayoutError", "does not match"),
    ("corrupt.zarr", "IntegrityError", "crc32c"),
])
def test_bad_checkpoints_are_rejected_with_the_same_error_on_every_rank(worlds, name, kind,
                                                                        words):
    _out, _saved, loaded = worlds
    errs = [rec[name] for rec in loaded]
    assert len({(e["type"], e["message"]) for e in errs}) == 1, errs
    assert errs[0]["type"] == kind and words in errs[0]["message"]
    assert all(e["unchanged"] for e in errs)


def test_verify_checks_every_shard_digest(worlds):
    import lean_store as ls

    out, _saved, _loaded = worlds
    for name in ("ck.zarr", "ck.h5"):
        report = ls.verify(out / name)
        assert report.ok and report.tensors == 16, str(report)
    report = ls.verify(out / "corrupt.zarr")
    assert report.bad_tensors == ["0.weight"]
    assert "shard [9:12, 0:8] (rank 3)" in str(report) and "crc32c" in str(report)


def test_single_process_rejects_bad_shards(worlds):
    import lean_store as ls
    from lean_store.errors import IntegrityError

    out, _saved, _loaded = worlds
    with pytest.raises(IntegrityError, match="overlap"):
        ls.open(out / "overlap.zarr")
    with pytest.raises(IntegrityError, match="missing"):
        ls.open(out / "missing.zarr")
    with pytest.raises(IntegrityError, match="overlap"):
        ls.load_state(out / "overlap.h5")


def test_a_rank_dying_mid_save_leaves_the_previous_checkpoint(tmp_path):
    import lean_store as ls

    recs = run_world("die", 2, tmp_path, expect_rc={1: 17})
    err = recs[0]["second_save"]
    assert err["type"] == "ShardedError" and "process group failed" in err["message"]
    state = ls.load_state(tmp_path / "die.zarr")
    assert np.array_equal(state["w"], np.ones((8, 3), np.float32))
    assert not [p for p in tmp_path.iterdir() if "lean_store-tmp" in p.name]


if __name__ == "__main__":
    gloo_world.main(SCENARIOS)
