"""Chunks stored with HDF5's fletcher32 filter (``checksum="fletcher32+crc32c"``, every
sharded HDF5 shard file) are read with one ``pread`` from their file offset, not through
``H5Dread_chunk``: both checksums are still checked, and HDF5's read is still used wherever the
chunk is not as recorded."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

import lean_store as ls
from lean_store.errors import CheckpointError
from lean_store.stores.hdf5 import store as hdf5_store


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {"m": rng.standard_normal((50, 16), dtype=np.float32),
            "v": np.arange(9, dtype=np.int32)}


def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "ck.h5"
    ls.save(_state(), path, checksum="fletcher32+crc32c", chunk_bytes=1024)
    return path


def _chunk(path: Path, node: str, k: int = 0) -> tuple[int, int]:
    with h5py.File(path, "r") as f:
        info = f[node].id.get_chunk_info(k)
        return info.byte_offset, info.size


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def test_chunks_are_read_without_h5dread_chunk(tmp_path: Path, monkeypatch) -> None:
    path = _saved(tmp_path)
    read = hdf5_store.HDF5Reader._pread_stored_chunk
    got_raw: list = []
    monkeypatch.setattr(hdf5_store.HDF5Reader, "_pread_stored_chunk", lambda self, *a: (
        got_raw.append(read(self, *a)), got_raw[-1])[1])
    with ls.open(path) as ck:
        chunks = [ck.stored(n).stored_shape[0] // ck.stored(n).chunk_shape[0] for n in ck]
        assert chunks[0] > 1  # several chunks
        got = {name: ck.read(name) for name in ck}
    for name, value in _state().items():
        assert got[name].tobytes() == value.tobytes()
    assert len(got_raw) >= sum(chunks) and None not in got_raw  # every one by pread


def test_a_changed_value_is_caught(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    offset, _size = _chunk(path, "m", 1)
    _flip(path, offset + 5)
    with pytest.raises(CheckpointError):
        ls.load_state(path)


def test_a_changed_fletcher32_checksum_is_caught(tmp_path: Path) -> None:
    """The values intact (their CRC-32C passes), HDF5's own checksum after them changed:
    still refused, as HDF5's reader refuses it."""
    path = _saved(tmp_path)
    offset, size = _chunk(path, "v")
    _flip(path, offset + size - 2)
    with pytest.raises(CheckpointError, match="fletcher32|checksum|Fletcher"):
        ls.load_state(path)


def test_without_the_direct_calls_hdf5_reads_the_chunks(tmp_path: Path, monkeypatch) -> None:
    path = _saved(tmp_path)
    monkeypatch.setattr(hdf5_store, "library", lambda: None)
    got = ls.load_state(path)
    for name, value in _state().items():
        assert got[name].tobytes() == value.tobytes()
