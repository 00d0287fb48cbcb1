"""One-chunk HDF5 datasets stored with Fletcher-32 alone (``checksum="fletcher32+crc32c"``, no
compression; what a sharded save's shard files hold) found from their object header's bytes
(stores/hdf5/header_layout.py): the pipeline message is accepted only when it is exactly
libhdf5's Fletcher-32 alone; such a dataset is read with one ``pread`` and never opened through
libhdf5, and a damaged chunk or checksum still fails with IntegrityError."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import assert_same_arrays
from test_hdf5_header_blosc import _found  # single_chunk's answer beside libhdf5's

import lean_store as ls
from lean_store.errors import IntegrityError
from lean_store.stores.hdf5.store import HDF5Reader


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {
        "w": rng.standard_normal((48, 32)).astype(np.float32),
        "b": rng.standard_normal(7).astype(np.float64),
        "n": np.arange(12, dtype=np.int16),
        "c": (rng.standard_normal(5) + 1j * rng.standard_normal(5)).astype(np.complex64),
        "big": rng.standard_normal((64, 256)).astype(np.float32),  # 64 KiB: 8 chunks below
    }


def _saved(tmp_path: Path, name: str = "ck.h5", checksum: str = "fletcher32+crc32c") -> Path:
    path = tmp_path / name
    ls.save(_state(), path, chunk_bytes=8192, checksum=checksum)
    return path


def test_fletcher_one_chunk_datasets_come_from_the_header(tmp_path: Path) -> None:
    """Offset and stored size (the bytes and 4 of checksum) are libhdf5's."""
    path = _saved(tmp_path)
    for name, (found, _codes, info, count) in _found(path).items():
        if count > 1:
            assert found is None, name
            continue
        assert found is not None, name
        assert found.fletcher32 and found.blosc is None, name
        assert (found.offset, found.size) == (info.byte_offset, info.size), name
        assert found.size == int(np.prod(found.chunks)) * found.itemsize + 4, name


def test_without_fletcher_the_flag_is_off(tmp_path: Path) -> None:
    path = _saved(tmp_path, checksum="crc32c")
    for name, (found, _codes, _info, count) in _found(path).items():
        if count == 1:
            assert found is not None and not found.fletcher32, name


def test_fletcher_one_chunk_datasets_are_never_opened(tmp_path: Path, monkeypatch) -> None:
    ls.load_state(_saved(tmp_path, "warm.h5"))
    path = _saved(tmp_path)
    opened: list[str] = []
    real = HDF5Reader._open_dataset
    monkeypatch.setattr(HDF5Reader, "_open_dataset",
                        lambda self, node: (opened.append(node), real(self, node))[1])
    assert_same_arrays(ls.load_state(path), _state())
    assert opened == ["big"]
    with ls.open(path) as ck:
        assert ck["w"][3:40:3, 5:9].tobytes() == _state()["w"][3:40:3, 5:9].tobytes()
        assert ck["c"].read().tobytes() == _state()["c"].tobytes()
    assert ls.verify(path).ok


@pytest.mark.parametrize("where", ["data", "checksum"])
def test_damage_fails_typed(tmp_path: Path, where: str) -> None:
    """A flipped byte in the chunk or in its Fletcher-32: IntegrityError at load, at read and
    in verify."""
    ls.load_state(_saved(tmp_path, "warm.h5"))
    path = _saved(tmp_path)
    found = _found(path)["w"][0]
    assert found is not None
    at = found.offset + (found.size // 2 if where == "data" else found.size - 2)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x21]))
    with pytest.raises(IntegrityError, match="'w'"):
        ls.load_state(path)
    with ls.open(path) as ck, pytest.raises(IntegrityError):
        ck["w"].read()
    assert not ls.verify(path).ok
