"""Zarr ``compression="weights"`` saves without zarr's codec pipeline (issue 15): lean_store
compresses each chunk with numcodecs' Blosc itself (on a thread pool) and writes the shard and
chunk files and every ``zarr.json`` directly; every file is byte for byte what zarr-python
writes for the same arrays and codecs, and zarr-python and lean_store read it back exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import zarr
from helpers import through_zarr_python, without_save_id

import lean_store as ls
from lean_store.stores.zarr.direct_write import blosc_settings, direct_ok

RNG = np.random.default_rng(15)


def _state(rows: int) -> dict[str, Any]:
    """Weights-like values: every case has a partial last shard and a partial last chunk."""
    w = RNG.standard_normal((rows, 128), dtype=np.float32) * 0.02
    return {
        "f32": w,
        "bf16": w[:, :64].astype(ml_dtypes.bfloat16),  # stored as raw uint16 words
        "f16": w[:, :64].astype(np.float16),
        "f8": w[:, :32].astype(ml_dtypes.float8_e4m3fn),  # raw bytes
        "f8_e5m2": w[:, :32].astype(ml_dtypes.float8_e5m2),
        "small": w[:3, :5].copy(),  # one unsharded chunk
        "vector": w[:, 0].copy(),
        "scalar": np.float32(0.5),
        "ints": RNG.integers(-9, 9, (rows, 16), dtype=np.int64),
        "empty": np.zeros((0, 4), np.float32),
    }


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _stock_save(state: dict[str, Any], path: Path, monkeypatch: pytest.MonkeyPatch,
                **kw: Any) -> None:
    """The same save through zarr-python's own codec pipeline and metadata writes."""
    with monkeypatch.context() as m:
        through_zarr_python(m)
        ls.save(state, path, compression="weights", **kw)


# 1 KiB chunks: many small chunks compressed on the caller; 64 KiB: shards compressed on the pool
@pytest.mark.parametrize(("chunk_bytes", "rows"), [(1024, 77), (64 << 10, 1100)])
def test_files_equal_zarrs_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               chunk_bytes: int, rows: int) -> None:
    state = _state(rows)
    ours_path, stock_path = tmp_path / "ours.zarr", tmp_path / "stock.zarr"
    with monkeypatch.context() as m:  # the direct writer makes every array, zarr none
        def refuse(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("zarr's create_array was used")
        m.setattr(zarr.Group, "create_array", refuse)
        ls.save(state, ours_path, compression="weights", chunk_bytes=chunk_bytes)
    _stock_save(state, stock_path, monkeypatch, chunk_bytes=chunk_bytes)
    ours, stock = without_save_id(_files(ours_path)), without_save_id(_files(stock_path))
    assert sorted(ours) == sorted(stock)
    assert [k for k in ours if ours[k] != stock[k]] == []
    group = zarr.open_group(str(ours_path), mode="r", zarr_format=3)
    sharded = set()
    for name in ("f32", "bf16", "f16", "f8", "f8_e5m2", "small", "vector", "ints"):
        doc = json.loads((ours_path / name / "zarr.json").read_bytes())
        shard = next((c["configuration"] for c in doc["codecs"]
                      if c["name"] == "sharding_indexed"), None)
        if shard is not None:
            sharded.add(name)
            shard_rows = doc["chunk_grid"]["configuration"]["chunk_shape"][0]
            assert doc["shape"][0] % shard_rows, name  # a partial last shard
        inner = doc["codecs"] if shard is None else shard["codecs"]
        assert [c["name"] for c in inner] == ["bytes", "blosc", "crc32c"], name
        settings = blosc_settings(inner[1])
        assert settings is not None and settings.typesize == group[name].dtype.itemsize
        assert direct_ok(doc, compressed=True) and not direct_ok(doc), name
    assert "f32" in sharded


def test_round_trip_exact(tmp_path: Path) -> None:
    state = _state(1100)
    path = tmp_path / "ck.zarr"
    ls.save(state, path, compression="weights", chunk_bytes=64 << 10)
    loaded = ls.load_state(path)
    for name, value in state.items():
        assert np.asarray(loaded[name]).tobytes() == np.asarray(value).tobytes(), name
    group = zarr.open_group(str(path), mode="r", zarr_format=3)
    for name in ("f32", "f16", "small", "vector", "ints"):
        np.testing.assert_array_equal(group[name][...], state[name])
    for name in ("bf16", "f8", "f8_e5m2"):  # raw words: the same bits
        assert np.asarray(group[name][...]).tobytes() == state[name].tobytes(), name


def test_compressed_chunk_corruption_detected(tmp_path: Path) -> None:
    path = tmp_path / "ck.zarr"
    ls.save(_state(1100), path, compression="weights", chunk_bytes=64 << 10)
    shard = path / "f32" / "c.1.0"  # the partial last shard
    raw = bytearray(shard.read_bytes())
    raw[40] ^= 0x10
    shard.write_bytes(bytes(raw))
    with pytest.raises(ls.CheckpointError):
        ls.load_state(path)


@pytest.mark.parametrize("codec", [
    {"name": "blosc", "configuration": {"typesize": 4, "cname": "zstd", "clevel": 1,
                                        "shuffle": "shuffle"}},  # blocksize unstated
    {"name": "blosc", "configuration": {"typesize": 4, "cname": "snappy", "clevel": 1,
                                        "shuffle": "shuffle", "blocksize": 0}},
    {"name": "blosc", "configuration": {"typesize": 0, "cname": "zstd", "clevel": 1,
                                        "shuffle": "shuffle", "blocksize": 0}},
    {"name": "blosc", "configuration": {"typesize": 4, "cname": "zstd", "clevel": True,
                                        "shuffle": "shuffle", "blocksize": 0}},
    {"name": "zstd", "configuration": {"level": 3, "checksum": False}},
])
def test_other_codecs_left_to_zarr(codec: dict[str, Any]) -> None:
    doc = {"codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, codec,
                      {"name": "crc32c"}]}
    assert not direct_ok(doc, compressed=True)


@pytest.mark.parametrize("compression", ["zstd", "gzip", "blosc"])
def test_other_compressions_go_through_zarr(tmp_path: Path, compression: str) -> None:
    """Only "weights" is written directly; the others are zarr's, and read back exactly."""
    state = _state(77)
    calls = []
    original = zarr.Group.create_array

    def spy(self: zarr.Group, *args: Any, **kwargs: Any) -> Any:
        calls.append(args[0] if args else kwargs.get("name"))
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(zarr.Group, "create_array", spy)
        ls.save(state, tmp_path / "ck.zarr", compression=compression, chunk_bytes=1024)
    assert len(calls) == len(state)
    loaded = ls.load_state(tmp_path / "ck.zarr")
    for name, value in state.items():
        assert np.asarray(loaded[name]).tobytes() == np.asarray(value).tobytes(), name


def test_tensorstore_reads_the_direct_files(tmp_path: Path) -> None:
    import tensorstore as ts  # a test dependency: the third reader of the Zarr stores

    state = _state(1100)
    path = tmp_path / "ck.zarr"
    ls.save(state, path, compression="weights", chunk_bytes=64 << 10)
    for name in ("f32", "bf16", "f16", "f8", "small", "vector", "ints"):
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{path}/{name}"}}
        array = ts.open(spec, read=True).result()
        assert np.asarray(array.read().result()).tobytes() == state[name].tobytes(), name


def test_failed_compression_leaves_no_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    """A chunk whose compression fails on the pool fails the save: nothing at the path, no
    temporary left, and an earlier checkpoint there untouched."""
    from lean_store.stores.zarr import direct_write

    path = tmp_path / "ck.zarr"
    ls.save({"w": np.ones(4, np.float32)}, path, compression="weights")
    before = _files(path)
    calls = []
    original = direct_write.BloscSettings.compress

    def failing(self: direct_write.BloscSettings, chunk: np.ndarray) -> bytes:
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("no memory for the frame")
        return original(self, chunk)

    monkeypatch.setattr(direct_write.BloscSettings, "compress", failing)
    with pytest.raises(MemoryError):
        ls.save(_state(1100), path, compression="weights", chunk_bytes=64 << 10)
    assert len(calls) >= 3
    assert _files(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.zarr"]
