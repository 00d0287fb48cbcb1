"""SaveOptions: one options object for every save verb, and every path honours each option or
raises naming it. The sharded half runs a 2-rank gloo world (``python test_save_options.py
SCENARIO RANK WORLD PORT DIR``, as tests/test_distributed.py does)."""

from __future__ import annotations

import dataclasses
import io
import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from torch_optional import require_torch

import lean_store as ls
from lean_store import CheckpointError, SaveOptions

HERE = Path(__file__).resolve()
ROWS, COLS = 64, 256  # float32: 64 KiB, 32 rows per rank in a 2-rank world


def state() -> dict[str, np.ndarray]:
    return {"w": np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS),
            "b": np.arange(7, dtype=np.int64)}


def zarr_codecs(path: Path, node: str = "w") -> list[str]:
    doc = json.loads((path / node / "zarr.json").read_text())
    names = [c["name"] for c in doc["codecs"]]
    for c in doc["codecs"]:
        names += [inner["name"] for inner in c.get("configuration", {}).get("codecs", [])]
    return names


# --------------------------------------------------------------------- the options object


def test_save_options_is_a_frozen_root_export() -> None:
    opts = SaveOptions(chunk_bytes=8192)
    assert ls.SaveOptions is SaveOptions and "SaveOptions" in ls.__all__
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.chunk_bytes = 4096  # type: ignore[misc]
    assert opts.replace(compression="gzip") == SaveOptions(chunk_bytes=8192, compression="gzip")


@pytest.mark.parametrize("bad, field", [
    ({"chunk_bytes": 100}, "chunk_bytes"),
    ({"chunk_bytes": "4096"}, "chunk_bytes"),
    ({"buffer_bytes": 0}, "buffer_bytes"),
    ({"snapshot": "gpu"}, "snapshot"),
    ({"checksum": 32}, "checksum"),
    ({"storage_options": "anon"}, "storage_options"),
])
def test_bad_options_name_the_field(bad: dict, field: str) -> None:
    with pytest.raises(CheckpointError, match=field):
        SaveOptions(**bad)


def test_one_progress_default_for_every_verb() -> None:
    """``save`` and the training verbs share SaveOptions' default (None: a bar on a terminal
    for big jobs only); training saves used to default to False on their own."""
    import inspect

    assert SaveOptions().progress is None
    for verb in (ls.save, ls.save_training, ls.save_optimizer, ls.Checkpointer.save):
        default = inspect.signature(verb).parameters.get("progress")
        assert default is None or default.default is None, verb


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_options_and_keywords_write_the_same_checkpoint(tmp_path: Path, suffix: str) -> None:
    ls.save(state(), tmp_path / f"kw{suffix}", chunk_bytes=8192)
    ls.save(state(), tmp_path / f"opt{suffix}", options=SaveOptions(chunk_bytes=8192))
    with ls.open(tmp_path / f"kw{suffix}") as a, ls.open(tmp_path / f"opt{suffix}") as b:
        assert a["w"].chunks == b["w"].chunks == (8, COLS)


def test_a_field_given_both_ways_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="chunk_bytes given both"):
        ls.save(state(), tmp_path / "x.h5", options=SaveOptions(chunk_bytes=8192),
                chunk_bytes=4096)
    assert not (tmp_path / "x.h5").exists()
    # different fields combine
    ls.save(state(), tmp_path / "y.zarr", options=SaveOptions(chunk_bytes=8192),
            compression="gzip")
    assert "gzip" in zarr_codecs(tmp_path / "y.zarr")
    with ls.open(tmp_path / "y.zarr") as ck:
        assert ck["w"].chunks == (8, COLS)


def test_options_must_be_save_options(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="SaveOptions"):
        ls.save(state(), tmp_path / "x.h5", options={"chunk_bytes": 8192})  # type: ignore[arg-type]


def test_snapshot_on_a_blocking_save_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="snapshot is not supported by blocking saves"):
        ls.save(state(), tmp_path / "x.h5", snapshot="host")
    assert not (tmp_path / "x.h5").exists()


def test_storage_options_on_a_background_save_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="storage_options"):
        ls.save(state(), tmp_path / "x.zarr", blocking=False,
                options=SaveOptions(storage_options={"anon": True}))


def test_save_async_takes_options(tmp_path: Path) -> None:
    handle = ls.save_async(state(), tmp_path / "a.zarr",
                           options=SaveOptions(chunk_bytes=8192, compression="gzip"))
    assert isinstance(handle, ls.SaveHandle)
    handle.wait()
    assert "gzip" in zarr_codecs(tmp_path / "a.zarr")
    with ls.open(tmp_path / "a.zarr") as ck:
        assert ck["w"].chunks == (8, COLS)


# ------------------------------------------------------------------------ training saves


def _model_and_optimizer():
    torch = require_torch()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    return model, opt


def test_training_saves_take_chunk_bytes_and_checksum(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    path = tmp_path / "t.h5"
    ls.save_training(path, model=model, optimizer=opt, step=3, chunk_bytes=4096,
                     checksum="fletcher32+crc32c")
    with h5py.File(path, "r") as f:
        weight = f["model%2Fweight"]
        assert weight.fletcher32 and weight.chunks == (16, 64)
    info = ls.load_training(path, model=model, optimizer=opt)
    assert info.step == 3


def test_save_optimizer_takes_options(tmp_path: Path) -> None:
    _, opt = _model_and_optimizer()
    path = tmp_path / "o.zarr"
    ls.training.save_optimizer(opt, path, options=SaveOptions(compression="gzip"))
    names = [p.name for p in path.iterdir() if p.is_dir()]
    assert any("gzip" in zarr_codecs(path, n) for n in names)


def test_training_save_in_the_background(tmp_path: Path) -> None:
    torch = require_torch()
    model, opt = _model_and_optimizer()
    expected = model.weight.detach().clone()
    handle = ls.save_training(tmp_path / "t.zarr", model=model, optimizer=opt, step=1,
                              blocking=False, snapshot="host")
    assert isinstance(handle, ls.SaveHandle)
    with torch.no_grad():
        model.weight.fill_(7.0)  # after the snapshot: not in the checkpoint
    handle.wait()
    ls.load_training(tmp_path / "t.zarr", model=model, optimizer=opt)
    assert torch.equal(model.weight, expected)


def test_training_save_rejects_unknown_options(tmp_path: Path) -> None:
    model, _ = _model_and_optimizer()
    with pytest.raises(CheckpointError, match="chunk_size"):
        ls.save_training(tmp_path / "t.h5", model=model, chunk_size=4096)


def test_training_progress_draws_on_the_stream_given(tmp_path: Path) -> None:
    model, _ = _model_and_optimizer()
    stream = io.StringIO()
    ls.save_training(tmp_path / "t.h5", model=model, options=SaveOptions(progress=stream))
    assert "save t.h5" in stream.getvalue()


def test_checkpointer_options_apply_to_every_step(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    ckr = ls.Checkpointer(tmp_path / "run", backend="zarr",
                          options=SaveOptions(compression="gzip", chunk_bytes=4096))
    first = ckr.save(1, model=model, optimizer=opt)
    second = ckr.save(2, model=model, optimizer=opt, compression="zstd")  # overrides one field
    third = ckr.save(3, model=model, optimizer=opt, options=SaveOptions())  # replaces them all
    assert "gzip" in _all_codecs(first)
    assert "zstd" in _all_codecs(second) and "gzip" not in _all_codecs(second)
    assert not {"gzip", "zstd"} & set(_all_codecs(third))
    with ls.open(second) as ck:
        assert ck["model/weight"].chunks == (16, 64)
    with pytest.raises(CheckpointError, match="compression given both"):
        ckr.save(4, model=model, options=SaveOptions(compression="gzip"), compression="zstd")
    with pytest.raises(CheckpointError, match="snapshot"):
        ls.Checkpointer(tmp_path / "run2", snapshot="host")


def _all_codecs(path: Path) -> list[str]:
    return [name for node in path.iterdir() if (node / "zarr.json").exists() and node.is_dir()
            for name in zarr_codecs(path, node.name)]


# -------------------------------------------------------------------------- sharded saves


def scenario_options(rank: int, world: int, out: Path) -> dict:
    """Every save option on the sharded path: honoured, or refused on every rank."""
    import torch
    from test_distributed import outcome

    from lean_store.distributed import LocalShard

    half = ROWS // world
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)

    def sharded() -> dict:
        return {"w": LocalShard(full[rank * half:(rank + 1) * half].clone(), (ROWS, COLS),
                                (rank * half, 0))}

    rec: dict = {}
    st = sharded()
    handle = ls.save(st, out / "bg.zarr", blocking=False, snapshot="host")
    rec["handle_type"] = type(handle).__name__
    st["w"].tensor.fill_(-1.0)  # after the snapshot: not in the checkpoint
    if isinstance(handle, ls.SaveHandle):
        handle.wait()
    second = ls.save_async(sharded(), out / "bg2.h5")
    rec["bg_save_async"] = type(second).__name__
    second.wait()  # one sharded save at a time on a group: their collectives must not mix
    ls.save(sharded(), out / "bg2-wait.h5", blocking=False).wait()

    rec["chunked"] = outcome(lambda: ls.save(sharded(), out / "chunked.zarr", chunk_bytes=4096))
    rec["gzip"] = outcome(lambda: ls.save(sharded(), out / "gzip.zarr",
                                          options=SaveOptions(compression="gzip")))
    rec["gzip_h5"] = outcome(lambda: ls.save(sharded(), out / "gzip.h5", compression="gzip"))
    rec["zarr_crc32c"] = outcome(lambda: ls.save(sharded(), out / "crc.zarr", checksum="crc32c"))
    rec["zarr_fletcher"] = outcome(lambda: ls.save(sharded(), out / "no1.zarr",
                                                   checksum="fletcher32+crc32c"))
    rec["h5_fletcher"] = outcome(lambda: ls.save(sharded(), out / "fl.h5",
                                                 checksum="fletcher32+crc32c"))
    rec["h5_crc32c"] = outcome(lambda: ls.save(sharded(), out / "no2.h5", checksum="crc32c"))
    stream = io.StringIO()
    rec["progress"] = outcome(lambda: ls.save(sharded(), out / "progress.zarr", progress=stream))
    rec["progress_text"] = stream.getvalue()
    rec["buffer_bytes"] = outcome(lambda: ls.save(sharded(), out / "no3.zarr",
                                                  buffer_bytes=1 << 20))
    rec["storage_options"] = outcome(lambda: ls.save(sharded(), "file://" + str(out / "no4.zarr"),
                                                     storage_options={"auto_mkdir": True}))
    rec["bg_buffer_bytes"] = outcome(lambda: ls.save(sharded(), out / "no7.zarr",
                                                     blocking=False, buffer_bytes=1 << 20))
    rec["bg_checksum"] = outcome(lambda: ls.save(sharded(), out / "no8.h5", blocking=False,
                                                 checksum="crc32c"))
    rec["snapshot_blocking"] = outcome(lambda: ls.save(sharded(), out / "no5.zarr",
                                                       snapshot="host"))
    rec["both_ways"] = outcome(lambda: ls.save(sharded(), out / "no6.zarr", chunk_bytes=4096,
                                               options=SaveOptions(chunk_bytes=8192)))
    torch.manual_seed(5)  # the same replicated model on every rank
    model = torch.nn.Linear(64, 64)
    handle = ls.save_training(out / "train.zarr", model=model, step=2, chunk_bytes=4096,
                              process_group=torch.distributed.group.WORLD, blocking=False)
    rec["train_handle"] = type(handle).__name__
    handle.wait()
    return rec


SCENARIOS = {"options": scenario_options}


@pytest.fixture(scope="module")
def sharded_world(tmp_path_factory):
    require_torch()
    from test_distributed import run_world

    out = tmp_path_factory.mktemp("sharded_options")
    return out, run_world("options", 2, out, script=HERE)


def test_sharded_background_save_returns_a_handle_of_the_snapshot(sharded_world) -> None:
    out, recs = sharded_world
    want = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    for rec in recs:
        assert rec["handle_type"] == "SaveHandle" and rec["bg_save_async"] == "SaveHandle"
    for name in ("bg.zarr", "bg2.h5", "bg2-wait.h5"):
        assert np.array_equal(ls.load_state(out / name)["w"], want), name


def test_sharded_chunk_bytes_and_compression_are_honoured(sharded_world) -> None:
    out, recs = sharded_world
    for rec in recs:
        assert rec["chunked"]["type"] is None and rec["gzip"]["type"] is None
        assert rec["gzip_h5"]["type"] is None
    with ls.open(out / "chunked.zarr") as ck:
        assert ck["w"].chunks == (4, COLS)
    assert "gzip" in zarr_codecs(out / "gzip.zarr")
    with h5py.File(out / "gzip.h5" / "shard-00000-of-00002.h5", "r") as f:
        assert all(f[k].compression == "gzip" for k in f)
    for name in ("chunked.zarr", "gzip.zarr", "gzip.h5"):
        assert ls.verify(out / name).ok, name


def test_sharded_checksum_is_honoured_or_refused(sharded_world) -> None:
    out, recs = sharded_world
    for rec in recs:
        assert rec["zarr_crc32c"]["type"] is None and rec["h5_fletcher"]["type"] is None
        for key in ("zarr_fletcher", "h5_crc32c"):
            assert rec[key]["type"] == "CheckpointError", key
            assert "checksum" in rec[key]["message"], key
    assert not (out / "no1.zarr").exists() and not (out / "no2.h5").exists()


def test_sharded_progress_draws_a_bar_per_rank(sharded_world) -> None:
    _, recs = sharded_world
    for rank, rec in enumerate(recs):
        assert rec["progress"]["type"] is None
        assert f"(rank {rank})" in rec["progress_text"]


def test_sharded_training_save_takes_options_and_blocking(sharded_world) -> None:
    torch = require_torch()
    out, recs = sharded_world
    assert [rec["train_handle"] for rec in recs] == ["SaveHandle", "SaveHandle"]
    with ls.open(out / "train.zarr") as ck:
        assert ck["model/weight"].chunks == (16, 64)
    torch.manual_seed(5)
    model = torch.nn.Linear(64, 64)
    expected = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    assert ls.load_training(out / "train.zarr", model=model, rng=False).step == 2
    assert torch.equal(model.weight, expected)


@pytest.mark.parametrize("key, field", [("buffer_bytes", "buffer_bytes"),
                                        ("storage_options", "storage_options"),
                                        ("snapshot_blocking", "snapshot"),
                                        ("bg_buffer_bytes", "buffer_bytes"),
                                        ("bg_checksum", "checksum"),
                                        ("both_ways", "chunk_bytes")])
def test_sharded_refusals_name_the_option(sharded_world, key: str, field: str) -> None:
    out, recs = sharded_world
    for rec in recs:
        assert rec[key]["type"] == "CheckpointError" and field in rec[key]["message"]
    assert not [p for p in out.iterdir() if p.name.startswith("no")]


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    from test_distributed import worker

    _scenario, _rank, _world, _port, _out = sys.argv[1:6]
    worker(_scenario, int(_rank), int(_world), int(_port), Path(_out), SCENARIOS)
