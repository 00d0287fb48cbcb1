"""One-chunk HDF5 datasets found from their object header's bytes, at the address the root
group's hard link gives, and their chunk index (stores/hdf5/header_layout.py; issue 13): such
a dataset is read with ``pread`` and never opened through libhdf5, every other dataset is
opened as before, and nothing the open checks caught before goes unnoticed (a tampered
attribute, a link to another dataset, a changed datatype, a moved or corrupt chunk)."""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path

import h5py
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_same_arrays

import lean_store as ls
from lean_store.errors import CheckpointError, IntegrityError
from lean_store.stores.hdf5 import store as hdf5_store
from lean_store.stores.hdf5.header_layout import single_chunk
from lean_store.stores.hdf5.store import HDF5Reader


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "w": rng.standard_normal((4, 8)).astype(np.float32),
        "b": np.arange(5, dtype=np.int64),
        "s": np.array(1.5, np.float64),
        "h": rng.standard_normal(9).astype(ml_dtypes.bfloat16),
        "m": rng.standard_normal(6).astype(np.float16),
        "c": (rng.standard_normal(3) + 1j).astype(np.complex64),
        "flag": np.array([True, False, True]),
        "big": rng.standard_normal((64, 256)).astype(np.float32),  # 64 KiB: 16 chunks below
    }


def _saved(tmp_path: Path, name: str = "ck.h5", **kw) -> Path:
    path = tmp_path / name
    ls.save(_state(), path, chunk_bytes=kw.pop("chunk_bytes", 4096), **kw)
    return path


def _opened(monkeypatch) -> list[str]:
    """The datasets a reader opens through libhdf5."""
    seen: list[str] = []
    real = HDF5Reader._open_dataset

    def spy(self, node):
        seen.append(node)
        return real(self, node)

    monkeypatch.setattr(HDF5Reader, "_open_dataset", spy)
    return seen


def test_one_chunk_datasets_are_never_opened(tmp_path: Path, monkeypatch) -> None:
    """After a first load (libhdf5 confirms each datatype and attribute encoding once), a
    load opens only the dataset of several chunks."""
    ls.load_state(_saved(tmp_path, "warm.h5"))
    path = _saved(tmp_path)
    opened = _opened(monkeypatch)
    assert_same_arrays(ls.load_state(path), _state())
    assert opened == ["big"]
    assert ls.verify(path).ok  # (verify looks at every dataset's structure through h5py)
    opened.clear()
    with ls.open(path) as ck:
        for name in ("w", "b", "s"):
            assert ck[name].read().tobytes() == _state()[name].tobytes()
    assert "w" not in opened and "b" not in opened and "s" not in opened


def test_the_header_gives_what_libhdf5_gives(tmp_path: Path) -> None:
    """Shape, chunks, item size, chunk offset and size from the bytes equal libhdf5's
    answers; a dataset of several chunks is not one."""
    path = _saved(tmp_path)
    with h5py.File(path, "r") as f:
        fd = f.id.get_vfd_handle()
        size = os.fstat(fd).st_size
        addresses: dict[bytes, int] = {}
        f.id.links.iterate(lambda name, info: addresses.__setitem__(name, info.u), info=True)
        for name, address in addresses.items():
            found = single_chunk(lambda n, at: os.pread(fd, n, at), address, size)
            ds = f[name.decode()]
            if ds.id.get_num_chunks() > 1:
                assert found is None
                continue
            assert found is not None, name
            info = ds.id.get_chunk_info(0)
            assert (found.shape, found.chunks, found.itemsize) == (
                ds.shape, ds.chunks, ds.id.get_type().get_size())
            assert (found.offset, found.size) == (info.byte_offset, info.size)
            assert sorted(found.attributes) == sorted(k.encode() for k in ds.attrs)


def test_a_mixed_state_of_one_and_many_chunks(tmp_path: Path, monkeypatch) -> None:
    """Every tensor whole, partial reads of a one-chunk tensor, and load into a torch
    module's state where torch is present: bit for bit."""
    path = _saved(tmp_path)
    ls.load_state(path)
    opened = _opened(monkeypatch)
    with ls.open(path) as ck:
        assert ck["w"][1:3, 2:5].tobytes() == _state()["w"][1:3, 2:5].tobytes()
        assert ck["big"][5:9].tobytes() == _state()["big"][5:9].tobytes()
        assert_same_arrays({k: ck[k].read() for k in _state()}, _state())
    assert "w" in opened  # a partial read goes through libhdf5's chunk index, as before


def _repacked(tmp_path: Path, *options: str) -> Path:
    path = _saved(tmp_path, "orig.h5")
    copy = tmp_path / ("repacked" + "".join(o.strip("-") for o in options) + ".h5")
    subprocess.run(["h5repack", *options, str(path), str(copy)], check=True,
                   capture_output=True)
    return copy


@pytest.mark.parametrize("options", [(), ("-L",), ("-f", "GZIP=1"), ("-f", "SHUF")])
def test_h5repack_copies_load_bit_for_bit(tmp_path: Path, options: tuple[str, ...]) -> None:
    """h5repack moves every object (the root manifest comes along); whatever layout,
    index or filters the copy has, it loads exactly, through the header or through libhdf5.
    (Re-chunked datasets are read through their own attributes: docs/FORMAT.md 2.5.1.)"""
    copy = _repacked(tmp_path, *options)
    assert_same_arrays(ls.load_state(copy), _state())
    assert ls.verify(copy).ok


def test_filtered_datasets_are_opened(tmp_path: Path, monkeypatch) -> None:
    """A filter pipeline (here fletcher32 and gzip) is not read from the header: opened."""
    path = _saved(tmp_path, compression="gzip", checksum="fletcher32+crc32c")
    ls.load_state(path)
    opened = _opened(monkeypatch)
    assert_same_arrays(ls.load_state(path), _state())
    assert sorted(opened) == sorted(_state())


def test_a_tampered_attribute_is_caught(tmp_path: Path, monkeypatch) -> None:
    """The dataset is still found from its header; its attributes then differ from the
    record: the same IntegrityError at its first read as before, and verify fails."""
    ls.load_state(_saved(tmp_path, "warm.h5"))
    path = _saved(tmp_path)
    with h5py.File(path, "r+", libver=("v108", "v108")) as f:
        attrs = f["b"].attrs
        value = attrs["crc32c"]
        del attrs["crc32c"]
        attrs["crc32c"] = np.int64(value ^ 1)
    found: list[str] = []
    real = HDF5Reader._stored_from_header

    def spy(self, node, record):
        info = real(self, node, record)
        if info is not None:
            found.append(node)
        return info

    monkeypatch.setattr(HDF5Reader, "_stored_from_header", spy)
    with pytest.raises(IntegrityError, match="crc32c"):
        ls.load_state(path)
    assert "b" in found
    with ls.open(path) as ck:
        assert ck["w"].read().tobytes() == _state()["w"].tobytes()
        with pytest.raises(IntegrityError, match="attributes were changed"):
            ck["b"].read()
    assert not ls.verify(path).ok


def test_a_link_to_another_dataset_is_caught(tmp_path: Path) -> None:
    """Links swapped: "w" names the dataset written as "b" and the other way round. Each
    header is the linked dataset's, whose attributes are not its record's: IntegrityError."""
    ls.load_state(_saved(tmp_path, "warm.h5"))
    path = _saved(tmp_path)
    with h5py.File(path, "r+") as f:
        f.move("w", "tmp")
        f.move("b", "w")
        f.move("tmp", "b")
    with pytest.raises(CheckpointError):
        ls.load_state(path)
    assert not ls.verify(path).ok


def _node_header(path: Path, node: str) -> tuple[int, int]:
    with h5py.File(path, "r") as f:
        fd = f.id.get_vfd_handle()
        address = h5py.h5o.get_info(f[node].id).addr
        found = single_chunk(lambda n, at: os.pread(fd, n, at), address,
                             os.fstat(fd).st_size)
        assert found is not None
        return address, found.offset


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_a_corrupt_chunk_is_caught(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    _, offset = _node_header(path, "b")
    _patch(path, offset, b"\xff")
    with pytest.raises(IntegrityError, match="crc32c"):
        ls.load_state(path)
    assert not ls.verify(path).ok


def test_a_chunk_index_pointing_elsewhere_is_caught(tmp_path: Path) -> None:
    """The B-tree's child pointer of "w" moved to the chunk of "h" (written right after
    it, hence inside the file): the bytes read are not those the table records."""
    path = _saved(tmp_path)
    with h5py.File(path, "r") as f:
        fd = f.id.get_vfd_handle()
        address = h5py.h5o.get_info(f["w"].id).addr
        size = os.fstat(fd).st_size
        found = single_chunk(lambda n, at: os.pread(fd, n, at), address, size)
        assert found is not None
        raw = os.pread(fd, size, 0)
    pointer = struct.pack("<Q", found.offset)
    # the B-tree's child pointer, in the node written just after the header's first chunk
    # (the root's digest table, written last, holds the same number)
    at = raw.index(pointer, address)
    assert at < address + 1024
    _patch(path, at, struct.pack("<Q", found.offset + 8))
    with pytest.raises(CheckpointError):
        ls.load_state(path)
    assert not ls.verify(path).ok


def test_a_changed_datatype_is_caught(tmp_path: Path) -> None:
    """The datatype message of "b" (int64) rewritten as unsigned: bytes no libhdf5 check
    confirmed, so the type goes to libhdf5, which refuses the header (its checksum) or the
    type: a CheckpointError either way, never a wrong value."""
    ls.load_state(_saved(tmp_path, "warm.h5"))
    path = _saved(tmp_path)
    address, _ = _node_header(path, "b")
    with open(path, "rb") as f:
        f.seek(address)
        head = f.read(1024)
    with h5py.File(path, "r") as f:
        plist = f["b"].id.get_type()
        assert plist.get_sign() == h5py.h5t.SGN_2
    body = b"\x10\x08\x00\x00\x08\x00\x00\x00"  # fixed point, little endian, signed, 8 bytes
    at = head.index(body)
    _patch(path, address + at + 1, b"\x00")  # unsigned
    with pytest.raises(CheckpointError):
        ls.load_state(path)
    assert not ls.verify(path).ok


def test_the_header_path_is_off_without_a_plain_descriptor(tmp_path: Path, monkeypatch
                                                          ) -> None:
    """A file HDF5 reads through another driver (no descriptor of its own): every dataset is
    opened through libhdf5, with the same result."""
    path = _saved(tmp_path)
    monkeypatch.setattr(hdf5_store, "_h5_descriptor", lambda file: (None, 0))
    opened = _opened(monkeypatch)
    assert_same_arrays(ls.load_state(path), _state())
    assert sorted(opened) == sorted(_state())
