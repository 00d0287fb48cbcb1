"""One test per hostile-file case: each gets a clear CheckpointError subclass, quickly, with no
read outside the checkpoint and no allocation in proportion to a claimed size."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import h5_text

import lean_store as ls
from lean_store.stores.hdf5.store import HDF5Reader
from lean_store.stores.zarr.checks import check_zarr_key
from lean_store.stores.zarr.store import ZarrReader

STATE = {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "b": np.arange(5, dtype=np.int64)}


@pytest.fixture
def h5(tmp_path) -> Path:
    path = tmp_path / "ck.h5"
    ls.save(STATE, path)
    return path


@pytest.fixture
def zdir(tmp_path) -> Path:
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path)
    return path


def _rejected(path, error=ls.CheckpointError, match=None):
    with pytest.raises(error, match=match):
        ls.load_state(path)
    assert not ls.verify(path).ok


def _replace_h5_dataset(path: Path, name: str, make) -> None:
    """Swap dataset ``name`` for what ``make(file, name)`` creates, keeping its attributes."""
    with h5py.File(path, "r+") as f:
        attrs = dict(f[name].attrs)
        del f[name]
        obj = make(f, name)
        if isinstance(obj, h5py.Dataset):
            for k, v in attrs.items():
                obj.attrs[k] = h5_text(v.decode()) if isinstance(v, bytes) else v


def _edit_json(file: Path, edit) -> None:
    meta = json.loads(file.read_text())
    edit(meta)
    file.write_text(json.dumps(meta))


def _set_layout_shape(meta: dict, name: str, shape: list[int]) -> None:
    layout = json.loads(meta["attributes"]["layout"])
    for entry in layout:
        if entry["name"] == name:
            entry["shape"] = shape
    meta["attributes"]["layout"] = json.dumps(layout)


# ------------------------------------------------------------------------------------- HDF5


def test_hdf5_external_link_to_etc_passwd(h5):
    link = h5py.ExternalLink("/etc/passwd", "/x")
    _replace_h5_dataset(h5, "w", lambda f, n: f.__setitem__(n, link))
    _rejected(h5, ls.UnsafeFileError, "ExternalLink")


def test_hdf5_soft_link(h5):
    _replace_h5_dataset(h5, "w", lambda f, n: f.__setitem__(n, h5py.SoftLink("/b")))
    _rejected(h5, ls.UnsafeFileError, "SoftLink")


def test_hdf5_virtual_dataset_pointing_at_etc_passwd(h5):
    def make(f, name):
        layout = h5py.VirtualLayout(shape=(8, 8), dtype=np.float32)
        layout[:] = h5py.VirtualSource("/etc/passwd", "data", shape=(8, 8))
        return f.create_virtual_dataset(name, layout)

    _replace_h5_dataset(h5, "w", make)
    _rejected(h5, ls.UnsafeFileError, "virtual")


def test_hdf5_external_raw_storage(h5):
    size = os.path.getsize("/etc/passwd") if os.path.exists("/etc/passwd") else 256
    _replace_h5_dataset(
        h5, "w",
        lambda f, n: f.create_dataset(n, (8, 8), np.float32, external=[("/etc/passwd", 0, size)]),
    )
    _rejected(h5, ls.UnsafeFileError, "external")


def test_hdf5_unknown_filter(h5):
    _replace_h5_dataset(
        h5, "w",
        lambda f, n: f.create_dataset(n, data=STATE["w"], chunks=(4, 8), scaleoffset=10),
    )
    _rejected(h5, ls.UnsafeFileError, "filter")


def test_hdf5_shape_of_1e15_elements(h5):
    with h5py.File(h5, "r+") as f:
        layout = json.loads(f.attrs["layout"])
        layout[0]["shape"] = [10**15]
        f.attrs["layout"] = h5_text(json.dumps(layout))
    _rejected(h5, ls.IntegrityError, "absurd shape")


def test_hdf5_consistent_huge_claim_without_data_is_not_allocated(h5):
    """2^40 elements claimed everywhere (below the hard cap) but no chunk present."""
    shape = (1 << 20, 1 << 20)
    _replace_h5_dataset(
        h5, "w",
        lambda f, n: f.create_dataset(n, shape, np.float32, chunks=(1, 1024), fletcher32=True),
    )
    with h5py.File(h5, "r+") as f:
        layout = json.loads(f.attrs["layout"])
        layout[0]["shape"] = list(shape)
        f.attrs["layout"] = h5_text(json.dumps(layout))
        f["w"].attrs["shape"] = np.asarray(shape, dtype=np.int64)
    _rejected(h5, ls.IntegrityError, "chunks are present")


def test_hdf5_absurd_chunk_shape(h5):
    _replace_h5_dataset(
        h5, "w",
        lambda f, n: f.create_dataset(n, (1 << 28,), np.float64, chunks=(1 << 28,),
                                      fletcher32=True),
    )
    _rejected(h5, ls.CheckpointError)
    reader = HDF5Reader(h5)  # the chunk check itself, before any chunk index walk
    with pytest.raises(ls.UnsafeFileError, match="chunk shape"):
        reader.stored("w")
    reader.close()


@pytest.mark.parametrize(
    "key, value",
    [
        ("format_version", "1"),  # wrong type
        ("format_version", 1.0),
        ("layout", np.arange(3)),  # not text
        ("layout", "{not json"),  # not JSON
        ("tensor_count", "2"),
        ("kind", "pickle"),
    ],
)
def test_hdf5_root_attributes_of_the_wrong_type_or_not_json(h5, key, value):
    with h5py.File(h5, "r+") as f:
        f.attrs[key] = h5_text(value) if isinstance(value, str) else value
    _rejected(h5, ls.IntegrityError)


def test_hdf5_attribute_of_an_unsupported_type(h5):
    with h5py.File(h5, "r+") as f:
        f["w"].attrs["shape"] = np.zeros(2, dtype=[("a", "i4"), ("b", "f8")])
    _rejected(h5, ls.IntegrityError, "unsupported type")


def test_hdf5_absurdly_long_attribute(h5):
    with h5py.File(h5, "r+") as f:
        f.attrs["writer"] = h5_text("x" * ((64 << 20) + 1))
    _rejected(h5, ls.UnsafeFileError)


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9, 0.99])
def test_hdf5_truncated_file(h5, fraction):
    raw = h5.read_bytes()
    h5.write_bytes(raw[: int(len(raw) * fraction)])
    _rejected(h5)


@pytest.mark.parametrize("chunk_bytes", [None, 4096])  # one chunk (header path), several
@pytest.mark.parametrize("key, value", [
    ("shape", [2**70, 8]), ("shape", [2**63, 8]), ("index", 2**70), ("index", -(2**70)),
    ("width", 2**64),
])
def test_hdf5_manifest_values_past_int64_name_the_tensor(tmp_path, chunk_bytes, key, value):
    """A manifest record claiming a value no int64 attribute can hold (a dimension of 2**70)
    is an IntegrityError naming the tensor, not an OverflowError from encoding it."""
    from lean_store.stores.hdf5.manifest import MANIFEST_ATTR

    path = tmp_path / "ck.h5"
    big = {"w": np.arange(2048, dtype=np.float32).reshape(256, 8), "b": STATE["b"]}
    ls.save(big, path, **({} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}))
    with h5py.File(path, "r+") as f:
        doc = json.loads(f.attrs[MANIFEST_ATTR].decode())
        next(r for r in doc["tensors"] if r["node"] == "w")["attrs"][key] = value
        del f.attrs[MANIFEST_ATTR]
        f.attrs[MANIFEST_ATTR] = h5_text(json.dumps(doc))
        assert (f["w"].chunks == (256, 8)) == (chunk_bytes is None)
    _rejected(path, ls.IntegrityError, f"'w'.*{key}")


def test_hdf5_future_format_version(h5):
    with h5py.File(h5, "r+") as f:
        f.attrs["format_version"] = 2
    _rejected(h5, ls.IntegrityError, "newer")


# ------------------------------------------------------------------------------------- Zarr


@pytest.mark.parametrize("key", ["..", "../x", "a/../../etc", "/etc/passwd", "a\\..\\b", "a//b"])
def test_zarr_keys_that_escape_the_store(key):
    with pytest.raises(ls.UnsafeFileError):
        check_zarr_key(key)


def test_zarr_reader_refuses_escaping_node_names(zdir, tmp_path):
    shutil.copytree(zdir / "w", tmp_path / "outside")
    reader = ZarrReader(zdir)
    for node in ("../outside", str(tmp_path / "outside"), "w/../../outside"):
        with pytest.raises(ls.UnsafeFileError):
            reader.stored(node)
    reader.close()


def test_zarr_array_directory_symlinked_outside(zdir, tmp_path):
    outside = tmp_path / "outside"
    shutil.move(zdir / "w", outside)
    (zdir / "w").symlink_to(outside, target_is_directory=True)
    _rejected(zdir, ls.UnsafeFileError, "symlink")


def test_zarr_chunk_symlinked_to_etc_passwd(zdir):
    chunk = next(p for p in (zdir / "b").rglob("*") if p.is_file() and p.name != "zarr.json")
    chunk.unlink()
    chunk.symlink_to("/etc/passwd")
    _rejected(zdir, ls.UnsafeFileError, "symlink")


def test_zarr_metadata_symlinked_outside(zdir, tmp_path):
    meta = zdir / "b" / "zarr.json"
    shutil.copy(meta, tmp_path / "meta.json")
    meta.unlink()
    meta.symlink_to(tmp_path / "meta.json")
    _rejected(zdir, ls.UnsafeFileError, "symlink")


def test_zarr_shape_of_1e15_elements(zdir):
    _edit_json(zdir / "zarr.json", lambda m: _set_layout_shape(m, "w", [10**15]))
    _rejected(zdir, ls.IntegrityError, "absurd shape")


def test_zarr_consistent_huge_claim_without_data_is_not_allocated(zdir):
    shape = [1 << 20, 1 << 20]

    def grow(meta):
        meta["shape"] = shape
        meta["attributes"]["shape"] = shape

    def grow_root(meta):  # the layout and the consolidated copy, consistently
        _set_layout_shape(meta, "w", shape)
        grow(meta["consolidated_metadata"]["metadata"]["w"])

    _edit_json(zdir / "zarr.json", grow_root)
    _edit_json(zdir / "w" / "zarr.json", grow)
    _rejected(zdir, ls.IntegrityError, "chunk files are present")


@pytest.mark.parametrize("chunks", [[-1, 8], [0, 8], [1 << 40, 8]])
def test_zarr_negative_or_absurd_chunk_shape(zdir, chunks):
    def edit(meta):
        meta["chunk_grid"]["configuration"]["chunk_shape"] = chunks

    _edit_json(zdir / "w" / "zarr.json", edit)
    _rejected(zdir)


@pytest.mark.parametrize("codec", [{"name": "made_up_codec"}, {"name": "transpose",
                                   "configuration": {"order": [1, 0]}}])
def test_zarr_unknown_or_unsupported_codec(zdir, codec):
    _edit_json(zdir / "w" / "zarr.json", lambda m: m["codecs"].insert(0, codec))
    _rejected(zdir)


@pytest.mark.parametrize(
    "key, value",
    [("format_version", "1"), ("format_version", 1.5), ("layout", 5), ("layout", "{not json"),
     ("layout", [[1, 2]]), ("tensor_count", None), ("complete", "yes")],
)
def test_zarr_root_attributes_of_the_wrong_type_or_not_json(zdir, key, value):
    _edit_json(zdir / "zarr.json", lambda m: m["attributes"].__setitem__(key, value))
    _rejected(zdir, ls.IntegrityError)


def test_zarr_metadata_that_is_not_json(zdir):
    (zdir / "w" / "zarr.json").write_bytes(b"\x80\x81 not json {")
    _rejected(zdir, ls.IntegrityError)


def test_zarr_absurdly_long_metadata(zdir):
    _edit_json(zdir / "zarr.json", lambda m: m["attributes"].__setitem__("pad", "x" * (65 << 20)))
    _rejected(zdir, ls.UnsafeFileError, "metadata")


def test_zarr_truncated_directory(zdir):
    chunk = next(p for p in (zdir / "w").rglob("*") if p.is_file() and p.name != "zarr.json")
    chunk.write_bytes(chunk.read_bytes()[:-9])
    _rejected(zdir, ls.IntegrityError, "truncated")
    chunk.unlink()
    _rejected(zdir, ls.IntegrityError, "missing")


def test_zarr_missing_array_directory(zdir):
    shutil.rmtree(zdir / "b")
    _rejected(zdir, ls.IntegrityError)


def test_zarr_future_format_version(zdir):
    _edit_json(zdir / "zarr.json", lambda m: m["attributes"].__setitem__("format_version", 2))
    _rejected(zdir, ls.IntegrityError, "newer")
