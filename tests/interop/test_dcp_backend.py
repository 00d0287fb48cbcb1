"""lean_store as a torch.distributed.checkpoint (DCP) storage backend, and 2-D / strided DTensor
placements through lean_store's own sharded save.

Single-process tests run in pytest's process (DCP without a process group). The distributed
ones run real worlds of gloo ranks on loopback, like tests/distributed/test_distributed.py: this
file is run as a script once per rank (``python test_dcp_backend.py SCENARIO RANK WORLD PORT
DIR``), ranks record what they saw in ``DIR/<scenario>-<rank>.json`` and the tests assert on
those records.
One 4-rank world saves (FSDP2 on 4 ranks, TP + FSDP2 and HSDP on a 2x2 mesh), one 2-rank world
reshards and loads, and pytest itself loads at 1 process.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import gloo_world
import numpy as np
import pytest
from helpers import SUFFIX
from torch_optional import require_torch

torch = require_torch()
dcp = pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

import lean_store as ls  # noqa: E402
import lean_store.interop.dcp as lsd  # noqa: E402

HERE = Path(__file__).resolve()
WORLD_TIMEOUT = 180


def _bits(t):
    t = t.detach().cpu().contiguous()
    return str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def same(a, b) -> bool:
    return _bits(a) == _bits(b)


def as_torch(value) -> torch.Tensor:
    """A numpy array from ls.load_state as a torch tensor (bfloat16 through its bits)."""
    arr = np.ascontiguousarray(np.asarray(value))
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


# ------------------------------------------------------------------ single process (no group)


def sample_state():
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(10, 6, generator=g),
        "b16": torch.randn(5, 3, generator=g).bfloat16(),
        "d": torch.randn(4, generator=g).double(),
        "i": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "h": torch.randn(3, generator=g).half(),
        "empty": torch.zeros(0, 3),
    }


def empty_like_state(state):
    return {k: torch.zeros_like(v) for k, v in state.items()}


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_save_load_roundtrip_bit_exact(tmp_path, backend):
    state = sample_state()
    path = tmp_path / f"ck{SUFFIX[backend]}"
    dcp.save(state, storage_writer=lsd.StorageWriter(path), no_dist=True)
    target = empty_like_state(state)
    dcp.load(target, storage_reader=lsd.StorageReader(path), no_dist=True)
    for k in state:
        assert same(target[k], state[k]), k
    # an ordinary lean_store checkpoint: ls.load, ls.load_state, ls.open, verify
    again = empty_like_state(state)
    ls.load(again, path)
    for k in state:
        assert same(again[k], state[k]), k
    assert list(ls.load_state(path)) == list(state)
    with ls.open(path) as ck:
        assert same(torch.from_numpy(ck["w"][2:5]), state["w"][2:5])
        ck.verify()
    assert ls.verify(path).ok


def test_bfloat16_bits_are_stored_exactly(tmp_path):
    state = {"x": torch.tensor([1.0, -0.0, float("inf"), 3.140625]).bfloat16()}
    state["x"].view(torch.int16)[1] = 0x7FC1  # a NaN payload survives
    path = tmp_path / "b.zarr"
    dcp.save(state, storage_writer=lsd.StorageWriter(path), no_dist=True)
    target = {"x": torch.zeros(4, dtype=torch.bfloat16)}
    dcp.load(target, storage_reader=lsd.StorageReader(path), no_dist=True)
    assert same(target["x"], state["x"])
    with ls.open(path) as ck:
        assert ck["x"].format.tag == "bfloat16"


def test_plain_readers_see_the_tensors(tmp_path):
    import h5py
    import zarr

    state = sample_state()
    dcp.save(state, storage_writer=lsd.StorageWriter(tmp_path / "a.h5"), no_dist=True)
    dcp.save(state, storage_writer=lsd.StorageWriter(tmp_path / "a.zarr"), no_dist=True)
    with h5py.File(tmp_path / "a.h5" / "lean_store.h5", "r") as f:
        assert np.array_equal(f["w"][...], state["w"].numpy())
        assert f["w"].attrs["format"] in (b"float32", "float32")
    group = zarr.open_group(tmp_path / "a.zarr", mode="r")
    assert np.array_equal(group["i"][...], state["i"].numpy())
    assert group.attrs["complete"] is True
    assert "crc32c" in json.dumps(json.loads((tmp_path / "a.zarr" / "w" / "zarr.json")
                                             .read_text())["codecs"])


def test_async_save(tmp_path):
    state = sample_state()
    path = tmp_path / "async.h5"
    future = dcp.async_save(state, storage_writer=lsd.StorageWriter(path), no_dist=True)
    future.result()
    target = empty_like_state(state)
    dcp.load(target, storage_reader=lsd.StorageReader(path), no_dist=True)
    for k in state:
        assert same(target[k], state[k]), k


def test_async_save_of_a_relative_path_writes_where_it_was_called(tmp_path, monkeypatch):
    """DCP's async_save writes from a thread: a StorageWriter made with a relative path
    writes in the working directory of then, even when the caller changes it before the
    write ends. (A relative ``checkpoint_id`` given to async_save is resolved in DCP's thread,
    as DCP's own FileSystemWriter resolves it.)"""
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    state = sample_state()
    monkeypatch.chdir(tmp_path / "first")
    writer = lsd.StorageWriter("async.zarr")
    future = dcp.async_save(state, storage_writer=writer, no_dist=True)
    monkeypatch.chdir(tmp_path / "second")
    future.result()
    assert [p.name for p in (tmp_path / "first").iterdir()] == ["async.zarr"]
    assert list((tmp_path / "second").iterdir()) == []
    target = empty_like_state(state)
    dcp.load(target, storage_reader=lsd.StorageReader(tmp_path / "first" / "async.zarr"),
             no_dist=True)
    assert all(same(target[k], state[k]) for k in state)


def test_checkpoint_id_and_overwrite_is_atomic(tmp_path):
    path = tmp_path / "step.zarr"
    writer = lsd.StorageWriter()
    dcp.save({"x": torch.ones(3)}, checkpoint_id=path, storage_writer=writer, no_dist=True)
    dcp.save({"x": torch.full((3,), 2.0)}, checkpoint_id=path, storage_writer=writer,
             no_dist=True)
    assert np.array_equal(ls.load_state(path)["x"], np.full(3, 2.0, np.float32))
    assert [p.name for p in tmp_path.iterdir()] == ["step.zarr"]
    assert lsd.StorageWriter.validate_checkpoint_id(tmp_path / "x.h5")
    assert not lsd.StorageWriter.validate_checkpoint_id(tmp_path / "x.bin")
    assert lsd.StorageReader.validate_checkpoint_id(path)
    assert not lsd.StorageReader.validate_checkpoint_id(tmp_path / "missing.zarr")


def test_ls_save_is_read_by_dcp_load(tmp_path):
    state = sample_state()
    for suffix in (".h5", ".zarr"):
        path = tmp_path / f"ls{suffix}"
        ls.save(state, path)
        target = empty_like_state(state)
        dcp.load(target, storage_reader=lsd.StorageReader(path), no_dist=True)
        for k in state:
            assert same(target[k], state[k]), (suffix, k)


def test_dcp_reshards_a_single_process_checkpoint_into_chunks(tmp_path):
    """DCP's planner reads regions: a target that is a narrow view of the stored tensor."""
    full = torch.arange(60, dtype=torch.float32).reshape(10, 6)
    path = tmp_path / "full.h5"
    ls.save({"w": full}, path)
    reader = lsd.StorageReader(path)
    meta = reader.read_metadata()
    assert meta.state_dict_metadata["w"].size == torch.Size([10, 6])
    assert [tuple(c.sizes) for c in meta.state_dict_metadata["w"].chunks] == [(10, 6)]
    reader.close()


PLAIN = {"step": 7, "lr": 0.1, "name": "run-1", "flag": True, "none": None,
         "betas": (0.9, 0.999), "big": 2**70, "nan": float("nan"), "nested": [1, {"a": (2, 3)}]}


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_plain_non_tensor_values_are_stored_without_pickle(tmp_path, backend):
    path = tmp_path / f"o{SUFFIX[backend]}"
    state = {"w": torch.ones(2), **PLAIN}
    dcp.save(state, storage_writer=lsd.StorageWriter(path), no_dist=True)
    with ls.open(path) as ck:
        text = ck.root_attrs["dcp"]
    assert "pickle" not in text and '"$tuple"' in text
    target = {"w": torch.zeros(2), **{k: None for k in PLAIN}}
    target["nested"] = [None, {"a": None}]
    dcp.load(target, storage_reader=lsd.StorageReader(path), no_dist=True)
    assert target["step"] == 7 and target["name"] == "run-1" and target["flag"] is True
    assert target["betas"] == (0.9, 0.999) and isinstance(target["betas"], tuple)
    assert target["big"] == 2**70 and target["none"] is None and np.isnan(target["nan"])
    assert target["nested"] == [1, {"a": (2, 3)}]


class Opaque:
    pass


def test_unpicklable_free_values_are_refused_naming_the_key(tmp_path):
    path = tmp_path / "r.zarr"
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(2), "cfg": {"obj": Opaque()}},
                 storage_writer=lsd.StorageWriter(path), no_dist=True)
    message = str(info.value)
    assert "state entry 'cfg.obj' (Opaque) cannot be stored without pickle" in message
    assert "set allow_pickle to True on lean_store.interop.dcp.StorageWriter" in message
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no temporary left


def test_allow_pickle_keeps_the_value_and_the_reader_must_opt_in(tmp_path):
    path = tmp_path / "p.zarr"
    value = io.BytesIO(b"abc")  # any value torch.save can pickle
    dcp.save({"w": torch.ones(2), "blob": value},
             storage_writer=lsd.StorageWriter(path, allow_pickle=True), no_dist=True)
    with pytest.raises(CheckpointException,
                       match=r"'blob' was stored pickled.*set allow_pickle to True"):
        dcp.load({"w": torch.zeros(2), "blob": None}, storage_reader=lsd.StorageReader(path),
                 no_dist=True)
    target = {"w": torch.zeros(2), "blob": None}
    dcp.load(target, storage_reader=lsd.StorageReader(path, allow_pickle=True), no_dist=True)
    assert target["blob"].getvalue() == b"abc"


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointException, match="missing.zarr"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=lsd.StorageReader(tmp_path / "missing.zarr"),
                 no_dist=True)


def test_strided_targets_must_tile_the_tensor():
    from lean_store.distributed.dtensor_blocks import check_target_cover

    tiled = [[["x", "(p)", [8, 3], [0, 0], [4, 3]]], [["x", "(p)", [8, 3], [4, 0], [4, 3]]]]
    check_target_cover(tiled)
    check_target_cover([tiled[0][0:1], tiled[0][0:1], tiled[1]])  # replicas are fine
    interleaved = [[["x", "(p)", [8, 3], [0, 0], [4, 3]]], [["x", "(p)", [8, 3], [2, 0], [4, 3]]]]
    with pytest.raises(ls.CheckpointError, match=r"tensor 'x'.*not one contiguous block.*"
                                                 r"lean_store.interop.dcp"):
        check_target_cover(interleaved)


# --------------------------------------------------------------------- distributed worlds


DIM = 16


class Cast(torch.nn.Module):
    def __init__(self, dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


def make_model(bf16: bool = True):
    """A small MLP whose last layer is bf16 (``bf16``); dyadic weights, identical on every
    rank."""
    g = torch.Generator().manual_seed(1234)
    last = torch.bfloat16 if bf16 else torch.float32
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.ReLU(),
                                torch.nn.Linear(2 * DIM, DIM), torch.nn.ReLU(), Cast(last),
                                torch.nn.Linear(DIM, DIM), Cast(torch.float32))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-8, 9, p.shape, generator=g).float() / 8)
    model[5].to(last)
    return model


def step(model, opt):
    g = torch.Generator().manual_seed(99)
    x = torch.randint(-4, 5, (6, DIM), generator=g).float()
    model(x).sum().backward()
    opt.step()


def fsdp_model(mesh, tp_mesh=None, bf16: bool = True):
    from torch.distributed.fsdp import fully_shard

    model = make_model(bf16)
    if tp_mesh is not None:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for i in (0, 2, 5):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state(model, opt) -> dict:
    """Every parameter and moment as a whole tensor (collective)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in model.state_dict().items():
        out[f"model.{k}"] = v.full_tensor() if isinstance(v, DTensor) else v
    names = {p: n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for key, v in st.items():
            out[f"optim.{names[p]}.{key}"] = v.full_tensor() if isinstance(v, DTensor) else v
    return out


def dcp_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": 3, "config": {"lr": 0.01, "betas": (0.9, 0.999)}}


def outcome(fn) -> dict:
    try:
        fn()
        return {"ok": True}
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "type": type(exc).__name__, "message": str(exc)}


def scenario_save4(rank: int, world: int, out: Path) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rec: dict = {}
    # FSDP2 on 4 ranks, through DCP into both backends
    mesh = init_device_mesh("cpu", (world,))
    model = fsdp_model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt)
    dcp.save(dcp_state(model, opt), storage_writer=lsd.StorageWriter(out / "fsdp.zarr"))
    dcp.async_save(dcp_state(model, opt),
                   storage_writer=lsd.StorageWriter(out / "fsdp.h5")).result()
    from torch.distributed.tensor import Shard as _Shard
    from torch.distributed.tensor import distribute_tensor as _distribute

    uneven = _distribute(torch.arange(9.0).reshape(3, 3), mesh, [_Shard(0)])  # rank 3: 0 rows
    for suffix in (".zarr", ".h5"):
        dcp.save({"u": uneven}, storage_writer=lsd.StorageWriter(out / f"uneven{suffix}"))
    rec["no_collectives"] = outcome(lambda: dcp.save(
        dcp_state(model, opt), storage_writer=lsd.StorageWriter(out / "nc.zarr"),
        use_collectives=False))
    ref = full_state(model, opt)
    if rank == 0:
        torch.save(ref, out / "ref1d.pt")
        ls.save({k: v for k, v in ref.items() if k.startswith("model.")}, out / "ls_full.zarr")
    dist.barrier()

    # TP + FSDP2 on a 2x2 mesh: strided shards, through lean_store's own save and through DCP
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model2 = fsdp_model(mesh2["dp"], tp_mesh=mesh2["tp"], bf16=False)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    step(model2, opt2)
    rec["placements"] = {k: str([type(p).__name__ for p in v.placements])
                         for k, v in model2.state_dict().items()}
    ref2 = full_state(model2, opt2)
    if rank == 0:
        torch.save(ref2, out / "ref2d.pt")
    rec["ls_save_2d"] = outcome(lambda: ls.save(model2.state_dict(), out / "tp.zarr",
                                                process_group=dist.group.WORLD))
    rec["ls_save_2d_h5"] = outcome(lambda: ls.save(model2.state_dict(), out / "tp.h5",
                                                   process_group=dist.group.WORLD))
    rec["save_training_2d"] = outcome(lambda: ls.save_training(
        out / "tp_train.h5", model=model2, optimizer=opt2, step=5,
        process_group=dist.group.WORLD))
    dcp.save(dcp_state(model2, opt2), storage_writer=lsd.StorageWriter(out / "tp_dcp.zarr"))

    # HSDP: Replicate across the outer mesh dimension, Shard(0) within
    model3 = fsdp_model(mesh2)
    rec["hsdp_placements"] = str([type(p).__name__ for p in model3[0].weight.placements])
    ref3 = {k: v.full_tensor() for k, v in model3.state_dict().items()}  # collective
    if rank == 0:
        torch.save(ref3, out / "ref_hsdp.pt")
    # the fallback for a torch without compute_local_shape_and_global_offset agrees with it
    from lean_store.distributed.dtensor_blocks import local_block, plain_block

    plain = [*model.state_dict().items(), *model3.state_dict().items(),
             ("2.weight", model2.state_dict()["2.weight"])]
    rec["fallback_agrees"] = [k for k, v in plain if plain_block(v) != local_block(k, v)]
    rec["ls_save_hsdp"] = outcome(lambda: ls.save(model3.state_dict(), out / "hsdp.zarr",
                                                  process_group=dist.group.WORLD))

    # interleaved strided rows and Partial are refused in plain words on every rank
    from torch.distributed.tensor import DTensor, Partial, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    bad = DTensor.from_local(torch.full((2, 3), float(rank)), mesh2,
                             [Shard(0), _StridedShard(0, split_factor=2)], run_check=False,
                             shape=torch.Size([8, 3]), stride=(3, 1))
    rec["interleaved"] = outcome(lambda: ls.save({"x": bad}, out / "bad.zarr"))
    from torch.distributed.tensor import distribute_tensor

    good = distribute_tensor(torch.arange(24.0).reshape(8, 3), mesh, [Shard(0)])
    ls.save({"x": good}, out / "x.zarr")
    rec["interleaved_load"] = outcome(lambda: ls.load({"x": bad}, out / "x.zarr"))
    rec["interleaved_untouched"] = bool((bad.to_local() == float(rank)).all())
    partial = DTensor.from_local(torch.ones(4), mesh, [Partial()], run_check=False)
    rec["partial"] = outcome(lambda: ls.save({"p": partial}, out / "partial.zarr"))
    return rec


def scenario_load2(rank: int, world: int, out: Path) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    rec: dict = {}
    mesh = init_device_mesh("cpu", (world,))
    ref = torch.load(out / "ref1d.pt")
    for name in ("fsdp.zarr", "fsdp.h5"):
        model = fsdp_model(mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step(model, opt)  # creates the moments; the load overwrites them
        for p in model.parameters():
            p.data.zero_()
        state = dcp_state(model, opt)
        state["step"], state["config"] = 0, {"lr": 0.0, "betas": None}
        dcp.load(state, storage_reader=lsd.StorageReader(out / name))
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        got = full_state(model, opt)
        rec[name] = sorted(k for k in ref if not same(got[k], ref[k]))
        rec[name + ":objects"] = [state["step"], list(state["config"]["betas"])]
    # ls.save (one process) -> dcp.load at 2 ranks
    model = fsdp_model(mesh)
    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=lsd.StorageReader(out / "ls_full.zarr"))
    got = full_state(model, torch.optim.AdamW(model.parameters()))
    rec["ls_full"] = sorted(k for k in got if not same(got[k], ref[k]))

    # the 2x2 TP + FSDP2 checkpoints, resharded onto FSDP2 over 2 ranks
    ref2 = torch.load(out / "ref2d.pt")
    for name in ("tp.zarr", "tp.h5"):
        model = fsdp_model(mesh, bf16=False)
        sd = model.state_dict()
        ls.load(sd, out / name, process_group=dist.group.WORLD)
        got = full_state(model, torch.optim.AdamW(model.parameters()))
        rec[name] = sorted(k for k in got if not same(got[k], ref2[k]))
    model = fsdp_model(mesh, bf16=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    info = ls.load_training(out / "tp_train.h5", model=model, optimizer=opt,
                            process_group=dist.group.WORLD)
    got = full_state(model, opt)
    rec["tp_train"] = sorted(k for k in ref2 if not same(got[k], ref2[k]))
    rec["tp_train_step"] = info.step
    model = fsdp_model(mesh, bf16=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt)
    state = dcp_state(model, opt)
    dcp.load(state, storage_reader=lsd.StorageReader(out / "tp_dcp.zarr"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = full_state(model, opt)
    rec["tp_dcp"] = sorted(k for k in ref2 if not same(got[k], ref2[k]))
    return rec


SCENARIOS = {"save4": scenario_save4, "load2": scenario_load2}


def run_world(scenario: str, world: int, out: Path) -> list[dict]:
    """Run this file as ``world`` ranks of ``scenario``; their records."""
    return gloo_world.run_world(HERE, scenario, world, out, timeout=WORLD_TIMEOUT)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp")
    saved = run_world("save4", 4, out)
    loaded = run_world("load2", 2, out)
    return out, saved, loaded


def test_fsdp2_four_ranks_reshard_to_two_bit_exact(worlds):
    _out, _saved, loaded = worlds
    for rec in loaded:
        assert rec["fsdp.zarr"] == [] and rec["fsdp.h5"] == []
        assert rec["fsdp.zarr:objects"] == [3, [0.9, 0.999]]
        assert rec["ls_full"] == []


@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_uneven_shards_with_an_empty_rank(worlds, suffix):
    out, _saved, _loaded = worlds
    target = {"u": torch.zeros(3, 3)}
    dcp.load(target, storage_reader=lsd.StorageReader(out / f"uneven{suffix}"), no_dist=True)
    assert same(target["u"], torch.arange(9.0).reshape(3, 3))
    with ls.open(out / f"uneven{suffix}") as ck:
        assert len(ck._shards["u"]) == 3


def test_without_collectives_the_writer_refuses(worlds):
    out, saved, _loaded = worlds
    for rec in saved:
        assert not rec["no_collectives"]["ok"]
        assert "use_collectives=True" in rec["no_collectives"]["message"]
    assert not (out / "nc.zarr").exists()


@pytest.mark.parametrize("name", ["fsdp.zarr", "fsdp.h5"])
def test_fsdp2_checkpoint_loads_in_one_process(worlds, name):
    out, _saved, _loaded = worlds
    ref = torch.load(out / "ref1d.pt")
    model = make_model()
    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=lsd.StorageReader(out / name), no_dist=True)
    for k, v in model.state_dict().items():
        assert same(v, ref[f"model.{k}"]), k
    # an ordinary sharded lean_store checkpoint: ls.load_state / verify / the recorded shards
    plain = ls.load_state(out / name)
    assert same(as_torch(plain["model.0.weight"]), ref["model.0.weight"])
    assert same(as_torch(plain["optim.state.2.weight.exp_avg"]),
                ref["optim.2.weight.exp_avg"])
    assert ls.verify(out / name).ok
    with ls.open(out / name) as ck:
        shards = ck._shards["model.0.weight"]
        assert sorted(s.rank for s in shards) == [0, 1, 2, 3]
        assert ck["model.5.weight"].format.tag == "bfloat16"


def test_fsdp2_hdf5_master_reads_with_h5py(worlds):
    import h5py

    out, _saved, _loaded = worlds
    ref = torch.load(out / "ref1d.pt")
    assert sorted(p.name for p in (out / "fsdp.h5").iterdir()) == [
        "lean_store.h5", *[f"shard-{r:05d}-of-00004.h5" for r in range(4)]]
    with h5py.File(out / "fsdp.h5" / "lean_store.h5", "r") as f:
        assert np.array_equal(f["model.2.weight"][...], ref["model.2.weight"].numpy())


def test_two_d_tp_fsdp2_saves_through_ls_save_and_reshards(worlds):
    _out, saved, loaded = worlds
    assert "_StridedShard" in saved[0]["placements"]["0.weight"]
    for rec in saved:
        assert rec["ls_save_2d"] == {"ok": True}
        assert rec["ls_save_2d_h5"] == {"ok": True}
        assert rec["save_training_2d"] == {"ok": True}
    for rec in loaded:
        assert rec["tp.zarr"] == [] and rec["tp.h5"] == []
        assert rec["tp_train"] == [] and rec["tp_train_step"] == 5
        assert rec["tp_dcp"] == []


def test_two_d_checkpoint_loads_in_one_process(worlds):
    out, _saved, _loaded = worlds
    ref = torch.load(out / "ref2d.pt")
    state = ls.load_state(out / "tp.zarr")
    for k, v in state.items():
        assert same(as_torch(v), ref[f"model.{k}"]), k


def test_hsdp_replicate_shard_saves_and_loads(worlds):
    out, saved, _loaded = worlds
    assert saved[0]["hsdp_placements"] == "['Replicate', 'Shard']"
    assert all(rec["ls_save_hsdp"] == {"ok": True} for rec in saved)
    assert all(rec["fallback_agrees"] == [] for rec in saved)
    ref = torch.load(out / "ref_hsdp.pt")
    state = ls.load_state(out / "hsdp.zarr")
    for k, v in state.items():
        assert same(as_torch(v), ref[k]), k
    with ls.open(out / "hsdp.zarr") as ck:
        assert len(ck._shards["0.weight"]) == 2  # replicas written once


def test_interleaved_strided_rows_and_partial_are_refused_in_plain_words(worlds):
    out, saved, _loaded = worlds
    messages = {rec["interleaved"]["message"] for rec in saved}
    assert len(messages) == 1  # the same error on every rank
    (message,) = messages
    assert "strided Shard(0) with split factor 2" in message
    assert "not one contiguous block" in message and "lean_store.interop.dcp" in message
    assert "_S(" not in message and "Partial" not in message
    load_messages = {rec["interleaved_load"]["message"] for rec in saved}
    assert len(load_messages) == 1 and "not one contiguous block" in load_messages.pop()
    assert all(rec["interleaved_untouched"] for rec in saved)
    partial = saved[0]["partial"]["message"]
    assert "Partial(sum)" in partial and "reduce" in partial
    assert not (out / "bad.zarr").exists() and not (out / "partial.zarr").exists()


if __name__ == "__main__":
    gloo_world.main(SCENARIOS, timeout_s=90)
