"""Every save option on the sharded path: honoured (blocking=False gives a SaveHandle of a
snapshot; chunk_bytes, compression, checksum, progress) or refused on every rank with a
CheckpointError naming it. A 2-rank gloo world on loopback runs this file as a script, one
process per rank (``python test_save_options_sharded.py SCENARIO RANK WORLD PORT DIR``); ranks
record what they saw in ``DIR/<scenario>-<rank>.json`` and the tests assert on those records and
on the files left behind. Every process has a timeout, so a broken collective fails a test."""

from __future__ import annotations

import io
import json
from pathlib import Path

import gloo_world
import h5py
import numpy as np
import pytest

import lean_store as ls
from lean_store import SaveOptions

HERE = Path(__file__).resolve()
ROWS, COLS = 64, 256  # float32: 64 KiB, 32 rows per rank in a 2-rank world
WORLD_TIMEOUT = 120


def zarr_codecs(path: Path, node: str = "w") -> list[str]:
    doc = json.loads((path / node / "zarr.json").read_text())
    names = [c["name"] for c in doc["codecs"]]
    for c in doc["codecs"]:
        names += [inner["name"] for inner in c.get("configuration", {}).get("codecs", [])]
    return names


def outcome(fn) -> dict:
    """Run ``fn``; the error it raised (type and message) or None."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - recorded for the test to assert on
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": None}


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


def run_world(scenario: str, world: int, out: Path) -> list[dict]:
    """Run this file as ``world`` ranks of ``scenario``; their records."""
    return gloo_world.run_world(HERE, scenario, world, out, timeout=WORLD_TIMEOUT)


@pytest.fixture(scope="module")
def sharded_world(tmp_path_factory):
    from torch_optional import require_torch

    require_torch()  # every test here runs torch.distributed
    out = tmp_path_factory.mktemp("sharded_options")
    return out, run_world("options", 2, out)


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
    import torch
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
    gloo_world.main(SCENARIOS, timeout_s=60)
