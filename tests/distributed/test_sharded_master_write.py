"""The sharded HDF5 master is written in two steps (issue 13): rank 0 writes its datasets during
the write stage, while the other ranks still write shards, and the commit adds the shard records,
the master manifest and the root attributes. The result equals the master written in one step
at the commit (as the DCP backend's coordinator does). One process, no torch."""

from __future__ import annotations

import json
from pathlib import Path

import h5py

from lean_store.distributed.plan import make_plan, shard_records
from lean_store.stores.hdf5.sharded import MASTER_NAME, write_master, write_master_datasets

LAYOUT = [{"index": 0, "name": "w", "shape": [4, 3], "format": "float32", "width": 32},
          {"index": 1, "name": "b", "shape": [3], "format": "bfloat16", "width": 16},
          {"index": 2, "name": "empty", "shape": [0, 2], "format": "float32", "width": 32}]
BOXES = [[[[0, 0], [2, 3]], [[0], [3]], [[0, 0], [0, 2]]],
         [[[2, 0], [2, 3]], [[0], [3]], [[0, 0], [0, 2]]]]


def _master(path: Path) -> dict:
    out: dict = {}
    with h5py.File(path / MASTER_NAME, "r") as f:
        out["root"] = {k: f.attrs[k] for k in f.attrs}
        for name in f:
            ds = f[name]
            out[name] = ({k: (ds.attrs[k].tolist() if hasattr(ds.attrs[k], "tolist")
                              else ds.attrs[k]) for k in ds.attrs},
                         [(s.vspace.get_select_bounds(), s.file_name, s.dset_name)
                          for s in ds.virtual_sources()] if ds.is_virtual else None,
                         ds.shape, ds.dtype.str)
    return out


def test_the_master_written_in_two_steps_equals_the_one_written_at_the_commit(tmp_path):
    _layout, plans = make_plan([{"layout": LAYOUT, "boxes": b} for b in BOXES])
    records = [shard_records(p, {k: [1234 + k, list(box.lengths)]
                                 for k, (box, _o) in enumerate(p.shards)}) for p in plans]
    root = {"lean_store": "lean_store", "sharded": json.dumps({"version": 1})}
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    write_master(str(one), 2, plans, records, root, 1 << 20)
    write_master_datasets(str(two), 2, plans, 1 << 20)
    with h5py.File(two / MASTER_NAME, "r") as f:  # before the commit: no complete, no shards
        assert "complete" not in f.attrs and "shards" not in f["w"].attrs
    write_master(str(two), 2, plans, records, root, 1 << 20)
    first, second = _master(one), _master(two)
    assert first == second
    assert first["w"][1] and first["empty"][1] is None  # virtual; the empty one is not
    manifest = json.loads(first["root"]["master_manifest"])
    assert [r["node"] for r in manifest["tensors"]] == ["w", "b", "empty"]
    assert manifest["tensors"][0]["attrs"]["shards"] == records[0]


def test_the_master_kept_open_from_the_write_stage_equals_the_one_written_at_the_commit(
        tmp_path):
    from lean_store.stores.hdf5.sharded import HDF5ShardedLayout

    _layout, plans = make_plan([{"layout": LAYOUT, "boxes": b} for b in BOXES])
    records = [shard_records(p, {k: [77 + k, list(box.lengths)]
                                 for k, (box, _o) in enumerate(p.shards)}) for p in plans]
    root = {"lean_store": "lean_store", "sharded": json.dumps({"version": 1})}
    one, kept = tmp_path / "one", tmp_path / "kept"
    one.mkdir()
    kept.mkdir()
    write_master(str(one), 2, plans, records, root, 1 << 20)
    shards = HDF5ShardedLayout()
    shards.write_metadata(str(kept), 2, plans, 1 << 20)
    shards.finish(str(kept), 2, plans, records, root, 1 << 20)
    assert _master(one) == _master(kept)


def test_an_aborted_save_closes_the_master_it_kept_open(tmp_path):
    from lean_store.stores.hdf5.sharded import HDF5ShardedLayout

    _layout, plans = make_plan([{"layout": LAYOUT, "boxes": b} for b in BOXES])
    shards = HDF5ShardedLayout()
    shards.write_metadata(str(tmp_path), 2, plans, 1 << 20)
    open_before = h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)
    shards.abort()
    assert h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE) == open_before - 1
    shards.abort()  # twice is harmless
    with h5py.File(tmp_path / MASTER_NAME, "w"):  # the file is free again
        pass
