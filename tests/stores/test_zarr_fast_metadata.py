"""Zarr metadata without zarr-python's per-array path (issue 13): the writer builds each array's
``zarr.json`` and the consolidated root itself, byte for byte what ``create_array`` and
``consolidate_metadata`` write; the reader describes arrays from the root's consolidated copy,
read once, and checks an array's own ``zarr.json`` against that copy when the tensor is read
and by ``verify``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import zarr
from helpers import through_zarr_python

import lean_store as ls
from lean_store.stores.zarr import checks as zarr_checks
from lean_store.stores.zarr import compat as zarr_compat
from lean_store.stores.zarr import store as zarr_store

RNG = np.random.default_rng(13)
STATE = {
    "f16": RNG.standard_normal((9, 5)).astype(np.float16),
    "f32_sharded": RNG.standard_normal((77, 32), dtype=np.float32),  # 10 chunks: sharded
    "f64": RNG.standard_normal(7),
    "i8": RNG.integers(-100, 100, 11, dtype=np.int8),
    "i16": RNG.integers(-100, 100, 11, dtype=np.int16),
    "i32": RNG.integers(-100, 100, (3, 4), dtype=np.int32),
    "i64": RNG.integers(-100, 100, 6, dtype=np.int64),
    "u8": RNG.integers(0, 255, 13, dtype=np.uint8),
    "u16": RNG.integers(0, 255, 13, dtype=np.uint16),
    "u32": RNG.integers(0, 255, 13, dtype=np.uint32),
    "u64": RNG.integers(0, 255, 13, dtype=np.uint64),
    "mask": RNG.random((41, 16)) > 0.5,
    "c64": (RNG.standard_normal((20, 4)) + 1j).astype(np.complex64),
    "c128": RNG.standard_normal(3) + 2j,
    "bf16": RNG.standard_normal((33, 8)).astype(ml_dtypes.bfloat16),  # raw words
    "f8": RNG.standard_normal(17).astype(ml_dtypes.float8_e4m3fn),  # raw bytes
    "empty": np.zeros((0, 4), np.float32),
    "scalar": np.float64(3.5),
    "Odd name/with.dots": np.arange(4, dtype=np.float32),  # escaped node name
}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _stock_save(path: Path, monkeypatch: pytest.MonkeyPatch, **kw) -> None:
    """The same save through zarr's own path: create_array, attribute update, consolidate."""
    with monkeypatch.context() as m:
        through_zarr_python(m)
        ls.save(STATE, path, **kw)


def test_metadata_bytes_equal_zarrs_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file, every array's zarr.json and the consolidated root included, is byte for
    byte what zarr-python writes for the same state (the root up to its per-save save_id)."""
    ls.save(STATE, tmp_path / "ours.zarr", chunk_bytes=1024)
    _stock_save(tmp_path / "stock.zarr", monkeypatch, chunk_bytes=1024)
    ours, stock = _files(tmp_path / "ours.zarr"), _files(tmp_path / "stock.zarr")
    assert sorted(ours) == sorted(stock)
    ours_root, stock_root = json.loads(ours.pop("zarr.json")), json.loads(stock.pop("zarr.json"))
    ours_root["attributes"]["save_id"] = stock_root["attributes"]["save_id"] = ""
    assert ours_root == stock_root  # the root as a document: zarr 3.1 orders its keys otherwise
    assert [k for k in ours if ours[k] != stock[k]] == []
    documents = [k for k in ours if k.endswith("/zarr.json")]
    assert len(documents) == len(STATE)
    sharded = json.loads(ours["f32_sharded/zarr.json"])["codecs"][0]["name"]
    assert sharded == "sharding_indexed"


def test_writer_never_calls_create_array_uncompressed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("create_array called on the direct path")

    monkeypatch.setattr(zarr.Group, "create_array", refuse)
    ls.save(STATE, tmp_path / "ck.zarr", chunk_bytes=1024)
    loaded = ls.load_state(tmp_path / "ck.zarr")
    for name, value in STATE.items():
        assert np.asarray(loaded[name]).tobytes() == np.asarray(value).tobytes(), name


def test_compressed_still_through_zarr(tmp_path: Path) -> None:
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path, compression="zstd", chunk_bytes=1024)
    meta = json.loads((path / "f64" / "zarr.json").read_text())
    assert [c["name"] for c in meta["codecs"]] == ["bytes", "zstd", "crc32c"]
    root = json.loads((path / "zarr.json").read_text())
    assert root["consolidated_metadata"]["metadata"]["f64"] == meta
    loaded = ls.load_state(path)
    assert np.array_equal(loaded["f64"], STATE["f64"])


def test_url_store_written_through_zarr(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/ck.zarr"
    ls.save(STATE, url, chunk_bytes=1024)
    loaded = ls.load_state(url)
    for name, value in STATE.items():
        assert np.asarray(loaded[name]).tobytes() == np.asarray(value).tobytes(), name
    root = json.loads((tmp_path / "ck.zarr" / "zarr.json").read_text())
    assert root["attributes"]["complete"] is True
    assert sorted(root["consolidated_metadata"]["metadata"]) == sorted(
        p.name for p in (tmp_path / "ck.zarr").iterdir() if p.is_dir())


@pytest.mark.parametrize("value", [
    {"a": [1.5, float("nan"), math.inf, -math.inf, True, False, None, "é\n\"\\", [], {}],
     "ü": -0.0, "big": 10**30, "tiny": 5e-324, "nested": {"b": {"c": [[1], [2, [3]]]}}},
    {},
    {"k": []},
])
@pytest.mark.parametrize("indent", [2, 0, 4])
def test_document_encoder_equals_json_dumps(value: dict, indent: int) -> None:
    with zarr.config.set({"json_indent": indent}):
        expected = json.dumps(value, indent=indent, allow_nan=True).encode()
        assert zarr_compat.json_document_bytes(value) == expected


@pytest.mark.parametrize("indent", [2, 0, 3])
def test_encoded_document_placed_in_a_larger_one(indent: int) -> None:
    inner = {"shape": [3, 4], "attributes": {"s": "a\nb", "n": {}}, "codecs": [{"name": "x"}]}
    outer = {"attributes": {"k": 1}, "metadata": {"a": inner, "b": {"shape": []}}}
    with zarr.config.set({"json_indent": indent}):
        placed = {"attributes": {"k": 1}, "metadata": {
            "a": zarr_compat.encoded_document(inner), "b": {"shape": []}}}
        expected = json.dumps(outer, indent=indent, allow_nan=True).encode()
        assert zarr_compat.json_document_bytes(placed) == expected


def test_stock_readers_read_the_store(tmp_path: Path) -> None:
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path, chunk_bytes=1024)
    for consolidated in (True, False):
        group = zarr.open_group(str(path), mode="r", zarr_format=3,
                                use_consolidated=consolidated)
        np.testing.assert_array_equal(group["f32_sharded"][...], STATE["f32_sharded"])
        np.testing.assert_array_equal(group["mask"][...], STATE["mask"])
        assert group["i32"].attrs["name"] == "i32"
    xr = pytest.importorskip("xarray")
    ds = xr.open_zarr(path, consolidated=True)
    np.testing.assert_array_equal(ds["f64"].values, STATE["f64"])
    np.testing.assert_array_equal(ds["c64"].values, STATE["c64"])


def _tamper(path: Path, node: str, edit) -> None:
    meta_path = path / node / "zarr.json"
    meta = json.loads(meta_path.read_text())
    edit(meta)
    meta_path.write_text(json.dumps(meta, indent=2))


@pytest.mark.parametrize("edit", [
    lambda m: m["attributes"].update(crc32c=1),
    lambda m: m["attributes"].update(name="other"),
    lambda m: m.update(dimension_names=["x", "y"]),
])
def test_tampered_array_document_caught_when_read(tmp_path: Path, edit) -> None:
    """Opening reads only the root; the array's own zarr.json, altered, no longer equals its
    consolidated copy, and reading that tensor (or verify) refuses it. Other tensors read."""
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path, chunk_bytes=1024)
    _tamper(path, "i32", edit)
    with ls.open(path) as ck:
        assert np.array_equal(ck["f64"], STATE["f64"])
        with pytest.raises(ls.IntegrityError, match="i32.*consolidated"):
            ck["i32"].read()
    with ls.open(path) as ck, pytest.raises(ls.IntegrityError, match="i32"):
        ck.verify()
    with pytest.raises(ls.IntegrityError, match="i32"):
        ls.load_state(path)


def test_tampered_empty_tensor_document_caught_by_verify(tmp_path: Path) -> None:
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path, chunk_bytes=1024)
    _tamper(path, "empty", lambda m: m["attributes"].update(name="other"))
    with ls.open(path) as ck, pytest.raises(ls.IntegrityError, match="empty"):
        ck.verify()


def _spy_documents(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys of every metadata file lean_store reads from here on, in order."""
    read: list[str] = []
    for module in (zarr_checks, zarr_store):
        real = module.read_bytes_at

        def spy(dir_fd: int, key: str, *args, real=real):
            read.append(key)
            return real(dir_fd, key, *args)

        monkeypatch.setattr(module, "read_bytes_at", spy)
    return read


@pytest.mark.parametrize("kept", [zarr_checks.KEPT_DOCUMENT_BYTES, 0])
def test_open_reads_each_document_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       kept: int) -> None:
    """The open reads the root and, in its walk, every array's own document (compared with
    its copy there and then); reads read no document again. Past KEPT_DOCUMENT_BYTES the walk
    keeps none, and each array's document is read at its first read instead."""
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path, chunk_bytes=1024)
    monkeypatch.setattr(zarr_checks, "KEPT_DOCUMENT_BYTES", kept)
    read = _spy_documents(monkeypatch)
    opened = zarr.open_array

    def no_open_array(*args, **kwargs):
        raise AssertionError("an array opened through zarr despite the consolidated copy")

    monkeypatch.setattr(zarr, "open_array", no_open_array)
    documents = sorted(f"{d.name}/zarr.json" for d in path.iterdir() if d.is_dir())
    assert len(documents) == len(STATE)
    with ls.open(path) as ck:
        at_open = list(read)
        assert sorted(at_open) == sorted(["zarr.json", *(documents if kept else [])])
        np.testing.assert_array_equal(ck["i64"], STATE["i64"])
        assert read == at_open + ([] if kept else ["i64/zarr.json"])
        ck.verify()
        assert sorted(read) == sorted(["zarr.json", *documents])  # each once in all
    monkeypatch.setattr(zarr, "open_array", opened)


def test_other_layouts_use_the_documents_the_walk_read(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A store zarr's pipeline wrote (zstd: not lean_store's direct layout) compares each
    array's own document at its first read, with the bytes the walk read: no second read;
    a changed document is still refused there."""
    path = tmp_path / "z.zarr"
    ls.save(STATE, path, compression="zstd", chunk_bytes=1024)
    read = _spy_documents(monkeypatch)
    with ls.open(path) as ck:
        at_open = sorted(read)
        assert len(at_open) == len(STATE) + 1  # the root and every array's document
        for name, value in STATE.items():
            assert np.asarray(ck[name].read()).tobytes() == value.tobytes()
        assert sorted(read) == at_open
    _tamper(path, "u8", lambda m: m["attributes"].update(name="other"))
    with ls.open(path) as ck, pytest.raises(ls.IntegrityError, match="u8"):
        ck["u8"].read()


@pytest.mark.parametrize("kept", [zarr_checks.KEPT_DOCUMENT_BYTES, 1500])
def test_document_read_in_the_walk_still_compared(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   kept: int) -> None:
    """An array's own document that differs from its copy in the root is refused by the read
    and the load as before, whether the walk kept it or not (1500 bytes: the walk keeps the
    first documents only)."""
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path, chunk_bytes=1024)
    monkeypatch.setattr(zarr_checks, "KEPT_DOCUMENT_BYTES", kept)
    for meta_path in path.glob("*/zarr.json"):
        meta_path.write_text(meta_path.read_text().replace('"index": ', '"index":  '))
    assert ls.load_state(path).keys() == STATE.keys()  # same values, other text: parsed
    _tamper(path, "u8", lambda m: m["attributes"].update(name="other"))
    with ls.open(path) as ck, pytest.raises(ls.IntegrityError, match="u8"):
        ck["u8"].read()
    with pytest.raises(ls.IntegrityError, match="u8"):
        ls.load_state(path)


def test_deep_array_document_refused_when_parsed(tmp_path: Path) -> None:
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path, chunk_bytes=1024)
    deep = "[" * 5000 + "]" * 5000
    _tamper(path, "u8", lambda m: m["attributes"].update(junk="DEEP"))
    meta_path = path / "u8" / "zarr.json"
    meta_path.write_text(meta_path.read_text().replace('"DEEP"', deep))
    with ls.open(path) as ck, pytest.raises(ls.UnsafeFileError, match="u8"):
        ck["u8"].read()


def test_store_without_consolidated_metadata_checks_array_documents(tmp_path: Path) -> None:
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path, chunk_bytes=1024)
    root = json.loads((path / "zarr.json").read_text())
    del root["consolidated_metadata"]
    (path / "zarr.json").write_text(json.dumps(root))
    loaded = ls.load_state(path)
    assert np.asarray(loaded["bf16"]).tobytes() == STATE["bf16"].tobytes()
    deep = "[" * 5000 + "]" * 5000
    _tamper(path, "u8", lambda m: m["attributes"].update(junk="DEEP"))
    meta_path = path / "u8" / "zarr.json"
    meta_path.write_text(meta_path.read_text().replace('"DEEP"', deep))
    with pytest.raises(ls.UnsafeFileError, match="u8"):
        ls.load_state(path)
