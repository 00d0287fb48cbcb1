"""One-chunk ``compression="weights"`` HDF5 datasets found from their object header's bytes
(stores/hdf5/header_layout.py, issue 15): the filter pipeline message is accepted only when it
is byte for byte Blosc 32001 with the parameters lean_store writes (then Fletcher-32 when the
checksum asks for it); such a dataset is read with one ``pread`` and never opened through
libhdf5, and a damaged frame, Fletcher-32 or CRC-32C still fails with IntegrityError."""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import h5py
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_same_arrays

import lean_store as ls
from lean_store.errors import CheckpointError, IntegrityError
from lean_store.stores.hdf5.blosc import blosc_parameters
from lean_store.stores.hdf5.header_layout import blosc_pipeline, single_chunk
from lean_store.stores.hdf5.store import HDF5Reader


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {
        "w": (rng.standard_normal((96, 64)) * 0.02).astype(np.float32),
        "b": (rng.standard_normal(7) * 0.02).astype(np.float32),
        "h": rng.standard_normal((33, 5)).astype(ml_dtypes.bfloat16),
        "n": np.arange(12, dtype=np.int64),
        "big": rng.standard_normal((64, 256)).astype(np.float32),  # 64 KiB: 16 chunks below
    }


def _saved(tmp_path: Path, name: str = "ck.h5", **kw) -> Path:
    path = tmp_path / name
    ls.save(_state(), path, chunk_bytes=4096 * 8, compression="weights", **kw)
    return path


def _found(path: Path) -> dict[str, object]:
    """single_chunk's answer for every dataset, with libhdf5's facts beside it."""
    out: dict[str, object] = {}
    with h5py.File(path, "r") as f:
        fd = f.id.get_vfd_handle()
        size = os.fstat(fd).st_size
        for name in f:
            ds = f[name]
            found = single_chunk(lambda n, at: os.pread(fd, n, at),
                                 h5py.h5o.get_info(ds.id).addr, size)
            dcpl = ds.id.get_create_plist()
            codes = [dcpl.get_filter(i)[0] for i in range(dcpl.get_nfilters())]
            info = ds.id.get_chunk_info(0) if ds.id.get_num_chunks() == 1 else None
            out[name] = (found, codes, info, ds.id.get_num_chunks())
    return out


@pytest.mark.parametrize("checksum", ["crc32c", "fletcher32+crc32c"])
def test_blosc_one_chunk_datasets_come_from_the_header(tmp_path: Path, checksum: str) -> None:
    """Offset and stored size are libhdf5's; the Fletcher-32 flag is the pipeline's."""
    path = _saved(tmp_path, checksum=checksum)
    seen_blosc = 0
    for name, (found, codes, info, count) in _found(path).items():
        if count > 1:
            assert found is None, name
            continue
        assert found is not None, name
        assert (found.offset, found.size) == (info.byte_offset, info.size)
        if 32001 in codes:
            seen_blosc += 1
            assert found.blosc is (checksum == "fletcher32+crc32c")
            assert found.size <= math.prod(found.chunks) * found.itemsize + 20
        else:
            assert found.blosc is None
    assert seen_blosc >= 3  # w, b, h at least


@pytest.mark.parametrize("checksum", ["crc32c", "fletcher32+crc32c"])
def test_one_chunk_blosc_datasets_are_never_opened(tmp_path: Path, monkeypatch,
                                                   checksum: str) -> None:
    ls.load_state(_saved(tmp_path, "warm.h5", checksum=checksum))
    path = _saved(tmp_path, checksum=checksum)
    opened: list[str] = []
    real = HDF5Reader._open_dataset
    monkeypatch.setattr(HDF5Reader, "_open_dataset",
                        lambda self, node: (opened.append(node), real(self, node))[1])
    assert_same_arrays(ls.load_state(path), _state())
    assert opened == ["big"]
    with ls.open(path) as ck:  # partial reads: through libhdf5's chunk record, same bytes
        assert ck["w"][3:50:2, 5:9].tobytes() == _state()["w"][3:50:2, 5:9].tobytes()
        assert ck["h"].read().tobytes() == _state()["h"].tobytes()
    assert ls.verify(path).ok


def _pipeline(itemsize: int, nbytes: int, *, flags: int = 1, params=None, version: int = 2,
              fletcher: bytes | None = None) -> tuple[int, bytes]:
    params = blosc_parameters(itemsize, nbytes) if params is None else params
    body = struct.pack("<HHHH", 32001, 0, flags, len(params)) + struct.pack(
        f"<{len(params)}I", *params)
    count = 1 if fletcher is None else 2
    return 1, bytes((version, count)) + body + (fletcher or b"")


def test_the_pipeline_is_checked_exactly() -> None:
    """Only lean_store's own pipeline is accepted; every other one goes to libhdf5."""
    assert blosc_pipeline(_pipeline(4, 4096), 4, 4096) is False
    f32 = struct.pack("<HHH", 3, 0, 0)
    assert blosc_pipeline(_pipeline(4, 4096, fletcher=f32), 4, 4096) is True
    wrong = [
        _pipeline(4, 4096, flags=0),  # Blosc mandatory
        _pipeline(2, 4096),  # another type size
        _pipeline(4, 8192),  # another chunk size
        _pipeline(4, 4096, params=(2, 2, 4, 4096, 5, 1, 5)),  # level 5
        _pipeline(4, 4096, params=(2, 2, 4, 4096, 1, 2, 5)),  # bitshuffle
        _pipeline(4, 4096, params=(2, 2, 4, 4096, 1, 1, 1)),  # lz4
        _pipeline(4, 4096, params=(2, 2, 4, 4096)),  # four parameters
        _pipeline(4, 4096, version=1),
        _pipeline(4, 4096, fletcher=struct.pack("<HHH", 3, 1, 0)),  # optional Fletcher-32
        _pipeline(4, 4096, fletcher=struct.pack("<HHH", 2, 0, 0)),  # shuffle after Blosc
        (0, _pipeline(4, 4096)[1]),  # message flags
        (1, _pipeline(4, 4096)[1] + b"\0"),  # a trailing byte
        (1, _pipeline(4, 4096)[1][:-1]),
    ]
    for message in wrong:
        assert blosc_pipeline(message, 4, 4096) is None, message


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _chunk(path: Path, node: str):
    found = _found(path)[node][0]
    assert found is not None and found.blosc is not None
    return found


@pytest.mark.parametrize("checksum", ["crc32c", "fletcher32+crc32c"])
@pytest.mark.parametrize("where", ["header size", "header format", "body", "last byte"])
def test_a_damaged_frame_fails_typed(tmp_path: Path, checksum: str, where: str) -> None:
    """A damaged Blosc frame, its Fletcher-32 or the decompressed bytes (CRC-32C): an
    IntegrityError at load and in verify, whatever is hit."""
    ls.load_state(_saved(tmp_path, "warm.h5", checksum=checksum))
    path = _saved(tmp_path, checksum=checksum)
    found = _chunk(path, "w")
    with open(path, "rb") as f:
        f.seek(found.offset)
        raw = f.read(found.size)
    at = {"header size": 4, "header format": 0, "body": found.size // 2,
          "last byte": found.size - 1}[where]
    _patch(path, found.offset + at, bytes([raw[at] ^ 0x5A]))
    with pytest.raises(IntegrityError):
        ls.load_state(path)
    with ls.open(path) as ck, pytest.raises(IntegrityError):
        ck["w"].read()
    assert not ls.verify(path).ok


def test_changed_filter_parameters_are_refused(tmp_path: Path) -> None:
    """The Blosc level in the header rewritten: not lean_store's pipeline, so libhdf5 opens
    the dataset and refuses it (the header's checksum or the parameters): never a load."""
    ls.load_state(_saved(tmp_path, "warm.h5"))
    path = _saved(tmp_path)
    with h5py.File(path, "r") as f:
        address = h5py.h5o.get_info(f["w"].id).addr
        nbytes = f["w"].id.get_create_plist().get_filter(0)[2][3]
    with open(path, "rb") as f:
        f.seek(address)
        head = f.read(4096)
    params = struct.pack("<7I", *blosc_parameters(4, nbytes))
    at = head.index(params) + 16  # the level
    _patch(path, address + at, struct.pack("<I", 7))
    with pytest.raises(CheckpointError):
        ls.load_state(path)
    assert not ls.verify(path).ok
