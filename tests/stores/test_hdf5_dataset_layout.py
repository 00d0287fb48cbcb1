"""A dataset's storage asked of libhdf5 directly (stores/hdf5/libhdf5.py dataset_layout,
chunk_info) says what h5py's calls say, and the reader describes every dataset the same way
either way."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from h5py import h5d

import lean_store as ls
from lean_store.stores.hdf5 import store as hdf5_store
from lean_store.stores.hdf5.libhdf5 import library
from lean_store.stores.hdf5.store import HDF5Reader

OPTIONS = [
    {},
    {"checksum": "fletcher32+crc32c"},
    {"compression": "gzip"},
    {"compression": "weights"},
    {"compression": "lzf"},
]


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"m": rng.standard_normal((40, 30), dtype=np.float32),
            "v": np.arange(7, dtype=np.int16), "s": np.array(2.5, np.float64),
            "e": np.zeros((0, 3), np.float32)}


@pytest.mark.parametrize("options", OPTIONS)
def test_the_layout_is_what_h5py_says(tmp_path: Path, options: dict) -> None:
    lib = library()
    assert lib is not None, "libhdf5 is not usable here, so its calls go untested"
    path = tmp_path / "ck.h5"
    ls.save(_state(), path, chunk_bytes=1024, **options)
    with h5py.File(path, "r") as f:
        for node in f:
            ds = f[node]
            dcpl = ds.id.get_create_plist()
            got = lib.dataset_layout(ds.id.id)
            assert got is not None
            assert got.layout == dcpl.get_layout()
            assert got.filters == tuple(dcpl.get_filter(i)[0]
                                        for i in range(dcpl.get_nfilters()))
            assert got.external == dcpl.get_external_count()
            assert got.shape == ds.shape and got.chunks == ds.chunks
            assert got.num_chunks == ds.id.get_num_chunks()
            assert got.storage_size == ds.id.get_storage_size()
            if ds.chunks and ds.size:
                for k in range(ds.id.get_num_chunks()):
                    info = ds.id.get_chunk_info(k)
                    assert lib.chunk_info(ds.id.id, info.chunk_offset) == (
                        info.filter_mask, info.byte_offset, info.size)
        assert lib.chunk_info(f["m"].id.id, (10**6, 0)) is None  # no such chunk


@pytest.mark.parametrize("options", OPTIONS)
def test_the_reader_describes_datasets_the_same_either_way(
    tmp_path: Path, monkeypatch, options: dict
) -> None:
    path = tmp_path / "ck.h5"
    ls.save(_state(), path, chunk_bytes=1024, **options)
    reader = HDF5Reader(path)
    try:
        fast = {node: reader.stored(node) for node in reader.nodes()}
    finally:
        reader.close()
    monkeypatch.setattr(hdf5_store, "library", lambda: None)
    reader = HDF5Reader(path)
    try:
        slow = {node: reader.stored(node) for node in reader.nodes()}
    finally:
        reader.close()
    assert fast == slow
    got = ls.load_state(path)
    for name, value in _state().items():
        assert got[name].tobytes() == value.tobytes()


def test_a_contiguous_dataset_is_not_described_from_the_manifest(tmp_path: Path) -> None:
    """A dataset repacked contiguous (h5repack -l CONTI) no longer fits its record: refused
    as before, whichever way its layout was asked."""
    path = tmp_path / "ck.h5"
    ls.save({"v": np.arange(7, dtype=np.int16)}, path)
    with h5py.File(path, "r+") as f:
        attrs = dict(f["v"].attrs)
        data = f["v"][...]
        del f["v"]
        f.create_dataset("v", data=data)
        for key, value in attrs.items():
            f["v"].attrs[key] = value
        assert f["v"].id.get_create_plist().get_layout() == h5d.CONTIGUOUS
    with pytest.raises(ls.CheckpointError):
        ls.load_state(path)


def test_chunk_location_is_the_same_through_libhdf5_and_through_h5py(
    tmp_path: Path, monkeypatch
) -> None:
    """The chunk lookup the writer and the reader share answers alike with the bound
    libhdf5 and through h5py's API (where the library cannot be bound): allocated chunks,
    an unallocated one, and a filtered one."""
    from lean_store.stores.hdf5 import libhdf5

    path = tmp_path / "raw.h5"
    with h5py.File(path, "w") as f:
        plain = f.create_dataset("plain", shape=(8, 4), dtype="f4", chunks=(2, 4))
        plain[:4] = 1.0  # chunks 0 and 1 written, 2 and 3 not
        f.create_dataset("packed", data=np.zeros((8, 4), "f4"), chunks=(4, 4),
                         compression="gzip")
        starts = {"plain": [(0, 0), (2, 0), (4, 0), (6, 0)], "packed": [(0, 0), (4, 0)]}
        fast = {n: [libhdf5.chunk_location(f[n].id, s) for s in ss] for n, ss in starts.items()}
        monkeypatch.setattr(libhdf5, "library", lambda: None)
        slow = {n: [libhdf5.chunk_location(f[n].id, s) for s in ss] for n, ss in starts.items()}
    # an unallocated chunk has no address; its mask is whatever the call left there (some
    # h5py releases leave it uninitialised): only the address is compared
    assert [loc[1] is None for loc in slow["plain"]] == [False, False, True, True]
    assert [loc[1] is None for loc in fast["plain"]] == [False, False, True, True]
    assert slow["plain"][:2] == fast["plain"][:2] and slow["packed"] == fast["packed"]
    assert all(loc[0] == 0 and loc[2] == 32 for loc in slow["plain"][:2])
    assert all(loc[1] is not None and loc[2] < 64 for loc in slow["packed"])
