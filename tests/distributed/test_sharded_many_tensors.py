"""Sharded checkpoints of many tensors load: their metadata that grows with the tensors (the
Zarr root with its consolidated metadata, the HDF5 master's ``master_manifest`` and
``manifest``) is bounded by what the checkpoint holds, not by the fixed limit of one document
(see tests/hostile/test_metadata_growing_with_tensors.py). Each rank lowers the fixed limits
to 64 KiB, so that 300 tensors cross them. A 2-rank gloo world on loopback runs this file as a
script, one process per rank."""

from __future__ import annotations

import os
from pathlib import Path

import gloo_world
import pytest

HERE = Path(__file__).resolve()
WORLD_TIMEOUT = 180
SMALL = 64 << 10
N = 300


def _state(rank: int, fill: float | None = None) -> dict:
    import torch

    from lean_store.distributed import LocalShard

    state = {}
    for i in range(N):
        full = torch.arange(8, dtype=torch.float32) + 100 * i
        part = full[4 * rank: 4 * (rank + 1)].clone()
        if fill is not None:
            part.fill_(fill)
        state[f"model.layers.{i // 24}.experts.{i % 24}.w"] = LocalShard(part, (8,), (4 * rank,))
    return state


def scenario_many(rank: int, world: int, out: Path) -> dict:
    import h5py

    import lean_store as ls
    from lean_store import hardening
    from lean_store.stores.zarr import checks as zarr_checks

    hardening.MAX_METADATA_BYTES = SMALL
    zarr_checks.MAX_METADATA_BYTES = SMALL
    hardening.MAX_ATTR_BYTES = SMALL
    rec: dict = {}
    for suffix in (".h5", ".zarr"):
        path = out / f"many{suffix}"
        ls.save(_state(rank), path)
        target = _state(rank, fill=-1.0)
        ls.load(target, path)
        want = _state(rank)
        rec[suffix] = all(target[k].tensor.equal(want[k].tensor) for k in want)
    if rank == 0:
        with h5py.File(out / "many.h5" / "lean_store.h5", "r") as f:
            rec["master_manifest_bytes"] = len(f.attrs["master_manifest"])
        rec["zarr_root_bytes"] = os.path.getsize(out / "many.zarr" / "zarr.json")
    return rec


SCENARIOS = {"many": scenario_many}


@pytest.fixture(scope="module")
def many_world(tmp_path_factory):
    return gloo_world.torch_world(tmp_path_factory, HERE, "many", 2, timeout=WORLD_TIMEOUT)


def test_sharded_checkpoints_of_many_tensors_load(many_world) -> None:
    for rec in many_world:
        assert rec[".h5"] and rec[".zarr"], rec
    first = many_world[0]
    assert first["master_manifest_bytes"] > SMALL and first["zarr_root_bytes"] > SMALL, first


if __name__ == "__main__":
    gloo_world.main(SCENARIOS, timeout_s=WORLD_TIMEOUT)
