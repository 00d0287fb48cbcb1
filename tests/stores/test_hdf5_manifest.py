"""The HDF5 root manifest: one read at open; dataset attributes checked against it on read and
by verify; files without it (older lean_store) still load through the per-dataset path."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

import lean_store as ls
from lean_store.stores.hdf5.manifest import MANIFEST_ATTR, parse_manifest
from lean_store.stores.hdf5.store import HDF5Reader, read_attrs, to_hdf5_attr

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "legacy_v0_adam.h5"


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "a.weight": rng.standard_normal((40, 30)).astype(np.float32),
        "a.bias": rng.standard_normal(30).astype(np.float32),
        "b": np.arange(7, dtype=np.int64),
        "scalar": np.array(2.5, dtype=np.float64),
    }


def _saved(tmp_path: Path, **kw) -> Path:
    path = tmp_path / "ck.h5"
    ls.save(_state(), path, **kw)
    return path


def _manifest(path: Path) -> dict:
    with h5py.File(path, "r") as f:
        return json.loads(f.attrs[MANIFEST_ATTR].decode())


def test_manifest_records_every_dataset_as_its_attributes_say(tmp_path: Path) -> None:
    path = _saved(tmp_path, chunk_bytes=4096)
    doc = _manifest(path)
    assert doc["version"] == 1
    with h5py.File(path, "r") as f:
        assert f.attrs[MANIFEST_ATTR].dtype.kind == "S"  # fixed-length: no global heap
        assert [r["node"] for r in doc["tensors"]] == list(f)
        for record in doc["tensors"]:
            ds = f[record["node"]]
            attrs = read_attrs(ds.id, record["node"])
            assert record["chunk_crc32c"] == attrs.pop("chunk_crc32c").tolist()
            assert {k: tuple(v) if isinstance(v, list) else v
                    for k, v in record["attrs"].items()} == attrs
            assert tuple(record["stored_shape"]) == ds.shape
            assert tuple(record["chunks"]) == ds.chunks
    assert len(doc["tensors"][0]["chunk_crc32c"]) > 1  # a multi-chunk table is recorded whole


def test_round_trip_with_the_manifest(tmp_path: Path) -> None:
    path = _saved(tmp_path, chunk_bytes=4096)
    got = ls.load_state(path)
    for name, value in _state().items():
        assert got[name].tobytes() == value.tobytes()
    assert ls.verify(path).ok


def test_open_reads_no_dataset_attribute(tmp_path: Path, monkeypatch) -> None:
    path = _saved(tmp_path)
    calls: list[str] = []
    import lean_store.stores.hdf5.store as hdf5

    real = hdf5.read_attrs
    monkeypatch.setattr(hdf5, "read_attrs", lambda oid, where, names=None: (
        calls.append(where), real(oid, where, names))[1])
    real_match = hdf5.attrs_match  # the comparison with the manifest, as read_attrs is
    monkeypatch.setattr(hdf5, "attrs_match", lambda oid, expected: (
        calls.append(repr(h5py.h5i.get_name(oid).decode()[1:])), real_match(oid, expected))[1])
    real_header = hdf5.header_match  # the same comparison from the object header's bytes
    monkeypatch.setattr(hdf5, "header_match", lambda messages, expected: (
        calls.append("header"), real_header(messages, expected))[1])
    real_root = hdf5.read_hdf5_attrs
    monkeypatch.setattr(hdf5, "read_hdf5_attrs", lambda obj, where, limits=None, ours=None: (
        calls.append(where), real_root(obj, where, limits, ours))[1])
    with ls.open(path) as ck:
        # the root's attributes only; a one-chunk dataset's object header is read at open
        # (stores/hdf5/header_layout.py), and its attributes compared from those bytes then
        assert len(ck) == 4 and calls[0] == str(path) and set(calls[1:]) <= {"header"}
        calls.clear()
        ck["b"].read()
        # checked once, at open from its header's bytes or when its data is first read:
        # from its header's bytes, and through libhdf5 where those are not (yet) known to
        # encode the attributes written
        assert calls in ([], ["header"], ["header", "'b'"], ["'b'"])
        checked = list(calls)
        ck["b"].read()
        assert calls == checked


@pytest.mark.parametrize("key, value", [
    ("shape", np.array([7, 1])),
    ("name", "c"),
    ("crc32c", 12345),
    ("format", "int32"),
    ("chunk_crc32c", np.array([1], np.uint32)),
])
def test_a_tampered_dataset_attribute_is_caught_on_read_and_by_verify(
    tmp_path: Path, key: str, value: object
) -> None:
    path = _saved(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["b"].attrs[key]
        f["b"].attrs[key] = to_hdf5_attr(value)
    with ls.open(path) as ck:
        ck["a.bias"].read()  # other tensors are unaffected
        with pytest.raises(ls.IntegrityError, match=rf"tensor 'b'.*attribute {key}"):
            ck["b"].read()
    with pytest.raises(ls.IntegrityError, match=rf"tensor 'b'.*attribute {key}"):
        ls.load_state(path)
    report = ls.verify(path)
    assert not report.ok and f"attribute {key}" in str(report)


def test_an_extra_dataset_attribute_is_caught(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    with h5py.File(path, "r+") as f:
        f["b"].attrs["note"] = to_hdf5_attr("hello")
    with pytest.raises(ls.IntegrityError, match="'b'.*attribute note was not written"):
        ls.load_state(path)


def test_a_forged_manifest_table_fails_the_chunk_check(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    doc = _manifest(path)
    doc["tensors"][2]["chunk_crc32c"] = [7]
    with h5py.File(path, "r+") as f:
        f["b"].attrs.modify("chunk_crc32c", np.array([7], np.uint32))  # both lie alike
        del f.attrs[MANIFEST_ATTR]
        f.attrs[MANIFEST_ATTR] = to_hdf5_attr(json.dumps(doc))
    with pytest.raises(ls.IntegrityError, match="'b'.*crc32c"):
        ls.load_state(path)


def test_files_without_a_manifest_load_through_the_old_path(tmp_path: Path) -> None:
    with h5py.File(FIXTURE, "r") as f:
        assert MANIFEST_ATTR not in f.attrs
    state = ls.load_state(FIXTURE)
    assert "state/weight/exp_avg" in state
    path = _saved(tmp_path)
    with h5py.File(path, "r+") as f:
        del f.attrs[MANIFEST_ATTR]
        f["b"].attrs["shape"] = np.array([7, 1])  # checked at open in such files
    with pytest.raises(ls.IntegrityError, match="attribute shape"):
        ls.open(path)


def test_a_rechunked_dataset_falls_back_to_its_own_attributes(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    with h5py.File(path, "r+") as f:
        data = f["b"][...]
        attrs = dict(f["b"].attrs)
        del f["b"]
        ds = f.create_dataset("b", data=data, chunks=(3,))
        for k, v in attrs.items():
            ds.attrs[k] = v
    with pytest.raises(ls.IntegrityError, match="re-chunked"):
        ls.open(path)


@pytest.mark.parametrize("text, error, match", [
    ("[" * 50 + "]" * 50, ls.UnsafeFileError, "nested"),
    ("{not json", ls.IntegrityError, "not valid JSON"),
    ('{"version": 2, "tensors": []}', ls.IntegrityError, "version"),
    ('{"version": 1, "tensors": [{"node": "b"}]}', ls.IntegrityError, "malformed manifest"),
    ('{"version": 1, "tensors": [{"node": "b", "attrs": {}, "stored_shape": [7], '
     '"chunks": [7], "chunk_crc32c": [1, 2]}]}', ls.IntegrityError, "chunk_crc32c"),
    ('{"version": 1, "tensors": [{"node": "b", "attrs": {}, "stored_shape": [-7], '
     '"chunks": [7], "chunk_crc32c": [1]}]}', ls.IntegrityError, "stored_shape"),
])
def test_hostile_manifests_are_refused(text: str, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        parse_manifest(text, "x.h5")


def test_a_hostile_manifest_in_a_file_is_refused_at_open(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    with h5py.File(path, "r+") as f:
        del f.attrs[MANIFEST_ATTR]
        f.attrs[MANIFEST_ATTR] = to_hdf5_attr("[" * 100 + "]" * 100)
    with pytest.raises(ls.UnsafeFileError, match="manifest"):
        ls.open(path)


def test_root_attrs_do_not_carry_the_manifest(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    reader = HDF5Reader(path)
    try:
        assert MANIFEST_ATTR not in reader.root_attrs
    finally:
        reader.close()


def test_small_compressed_chunks_are_not_handed_to_the_pool(tmp_path: Path, monkeypatch) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from lean_store.stores.hdf5 import deflate as hdf5_deflate

    submitted: list[int] = []
    real = ThreadPoolExecutor.submit
    monkeypatch.setattr(ThreadPoolExecutor, "submit", lambda self, fn, *a, **kw: (
        submitted.append(getattr(fn, "__name__", "")), real(self, fn, *a, **kw))[1])
    small = {f"b{i}": np.arange(100, dtype=np.float32) * i for i in range(20)}
    path = tmp_path / "c.h5"
    ls.save(small, path, compression="weights")
    assert "_encode" not in submitted
    big = {"w": np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)}
    ls.save(big, tmp_path / "d.h5", compression="weights", chunk_bytes=1 << 18)
    assert "_encode" in submitted  # chunks of 256 KiB still go to the pool
    assert hdf5_deflate.INLINE_BYTES < 1 << 18
    got = ls.load_state(path)
    assert all(got[k].tobytes() == v.tobytes() for k, v in small.items())
    assert ls.verify(path).ok and ls.verify(tmp_path / "d.h5").ok
