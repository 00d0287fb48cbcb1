"""Zarr save path: the crc32c encoder and the direct shard/chunk writer produce exactly the
bytes stock zarr writes, and stock zarr reads lean_store stores."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zarr
from helpers import through_zarr_python, without_save_id, zarr_chunk_files, zarr_layout_state
from zarr.codecs import Crc32cCodec
from zarr.core.array_spec import ArrayConfig, ArraySpec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.dtype import parse_data_type

import lean_store as ls
from lean_store.stores.zarr import compat as zarr_compat
from lean_store.stores.zarr.crc import LeanCrc32cCodec
from lean_store.stores.zarr.direct_write import direct_ok

RNG = np.random.default_rng(7)
STATE = zarr_layout_state(7)


def _files(root: Path) -> dict[str, bytes]:
    files = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    root_meta = json.loads(files["zarr.json"])  # save_id: unique per save, by design
    root_meta["attributes"].pop("save_id", None)
    files["zarr.json"] = json.dumps(root_meta, sort_keys=True).encode()
    return files


def _spec(n: int) -> ArraySpec:
    return ArraySpec(
        shape=(n,), dtype=parse_data_type(np.uint8, zarr_format=3), fill_value=0,
        config=ArrayConfig.from_dict({}), prototype=default_buffer_prototype(),
    )


@pytest.mark.parametrize("n", [0, 1, 7, 4096, 100_003])
def test_encoder_bytes_equal_stock(n: int) -> None:
    if not zarr_compat.LEAN_ENCODER:
        pytest.skip(f"zarr {zarr.__version__} has no _encode_sync hook: the stock codec is used")
    data = RNG.integers(0, 256, n, dtype=np.uint8)
    buf = default_buffer_prototype().buffer.from_array_like(data)
    ours = LeanCrc32cCodec()._encode_sync(buf, _spec(n))
    stock = Crc32cCodec()._encode_sync(buf, _spec(n))
    assert ours is not None and stock is not None
    assert bytes(ours.as_numpy_array()) == bytes(stock.as_numpy_array())
    assert LeanCrc32cCodec().to_dict() == {"name": "crc32c"}
    back = Crc32cCodec()._decode_sync(ours, _spec(n + 4))
    assert bytes(back.as_numpy_array()) == data.tobytes()


def test_store_bytes_equal_stock_zarr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file (chunks, shards with indexes, metadata) is identical to what zarr's own
    write path produces for the same arrays."""
    chunk_bytes = 1024  # 8 rows of 32 float32: sharded tensors have 8+ chunks
    ls.save(STATE, tmp_path / "ours.zarr", chunk_bytes=chunk_bytes)
    with monkeypatch.context() as m:
        through_zarr_python(m)
        ls.save(STATE, tmp_path / "stock.zarr", chunk_bytes=chunk_bytes)
    ours = without_save_id(_files(tmp_path / "ours.zarr"))
    stock = without_save_id(_files(tmp_path / "stock.zarr"))
    assert sorted(ours) == sorted(stock)
    assert sum("/c." in k for k in ours) >= 8
    assert [k for k in ours if ours[k] != stock[k]] == []
    group = zarr.open_group(str(tmp_path / "ours.zarr"), mode="r", zarr_format=3)
    for name in ("aligned", "edge", "small", "mask", "bf16", "c64"):  # the direct path was used
        assert direct_ok(group[name]), name


def test_stock_zarr_reads_lean_store(tmp_path: Path) -> None:
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path, chunk_bytes=1024)
    group = zarr.open_group(str(path), mode="r", zarr_format=3)
    for name in ("aligned", "edge", "small", "unsharded_edge", "mask", "c64"):
        np.testing.assert_array_equal(group[name][...], STATE[name])
    bits = np.asarray(group["bf16"][...])
    assert bits.tobytes() == STATE["bf16"].tobytes()
    loaded = ls.load_state(path)
    for name, value in STATE.items():
        assert np.asarray(loaded[name]).tobytes() == np.asarray(value).tobytes()


def test_corrupt_direct_chunk_detected(tmp_path: Path) -> None:
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path, chunk_bytes=1024)
    shard = zarr_chunk_files(path / "edge")[0]
    raw = bytearray(shard.read_bytes())
    raw[5] ^= 0x40
    shard.write_bytes(bytes(raw))
    with pytest.raises(ls.CheckpointError):
        ls.load_state(path)
