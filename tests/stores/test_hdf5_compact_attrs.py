"""Every HDF5 dataset lean_store writes keeps its attributes in its object header (compact
storage, docs/FORMAT.md 2.5; issue 13: HDF5's default moved the dozen attributes of each
dataset to dense storage, a fractal heap and B-tree per dataset). h5py reads them all, and an
attribute too large for the header (a chunk table over 64 KiB) still works."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

import lean_store as ls


def test_datasets_keep_attributes_compact(tmp_path: Path) -> None:
    path = tmp_path / "c.h5"
    ls.save({f"t{i}": np.arange(64, dtype=np.float32) + i for i in range(3)}, path)
    with h5py.File(path, "r") as f:
        for name in ("t0", "t1", "t2"):
            ds = f[name]
            assert ds.id.get_create_plist().get_attr_phase_change() == (32, 24)
            assert len(ds.attrs) >= 9  # more than HDF5's default compact limit of 8
            assert ds.attrs["name"] == name.encode()
    state = ls.load_state(path)
    assert np.array_equal(state["t2"], np.arange(64, dtype=np.float32) + 2)


def test_an_attribute_too_large_for_the_header_still_round_trips(tmp_path: Path) -> None:
    # a chunk table over 64 KiB (a tensor of more than 16,384 chunks), on a dataset made as
    # the writer makes them
    from h5py import h5d, h5p, h5s, h5t

    from lean_store.stores.hdf5.store import ATTR_PHASE_CHANGE, LIBVER, read_attrs, write_attrs

    table = np.arange(20_000, dtype=np.uint32)
    with h5py.File(tmp_path / "a.h5", "w", libver=LIBVER) as f:
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_chunk((4,))
        dcpl.set_attr_phase_change(*ATTR_PHASE_CHANGE)
        ds = h5d.create(f.id, b"x", h5t.IEEE_F32LE, h5s.create_simple((8,)), dcpl=dcpl)
        write_attrs(ds, {"index": 0, "chunk_crc32c": table, "name": "x"})
    with h5py.File(tmp_path / "a.h5", "r") as f:
        got = read_attrs(f["x"].id, "x")
        assert np.array_equal(got["chunk_crc32c"], table) and got["name"] == "x"
        assert np.array_equal(f["x"].attrs["chunk_crc32c"], table)
