"""Per-dataset attributes written on save through :func:`attrs.attr_row` (issue 13): values
unique to a dataset (index, name, CRCs, the CRC table) get only their bytes made, with the
types and dataspace of the first value of their kind. The attributes, and whole files, are
byte for byte those of the general encoding (:func:`encode_attr`, as main wrote them) and of
h5py's low-level API."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import h5py
import numpy as np
import pytest

import lean_store as ls
from lean_store import metadata
from lean_store.stores.hdf5 import attrs as attrs_module
from lean_store.stores.hdf5 import libhdf5
from lean_store.stores.hdf5 import store as hdf5_store
from lean_store.stores.hdf5.attrs import _row, attr_row, encode_attr

VALUES: list[tuple[str, Any]] = [
    ("index", 0), ("index", 7), ("index", 2**63 - 1), ("index", -(2**63)), ("crc32c", 2**32 - 1),
    ("index", 2**63), ("index", 2**64 - 1),  # beyond int64: numpy's uint64, the long way
    ("flag", True), ("ratio", 0.25),
    ("name", ""), ("name", "a"), ("name", "b"), ("name", "layer.0.weight"), ("name", "ü€𝄞"),
    ("name", "tail\x00"), ("name", "x" * 300),
    ("shape", ()), ("shape", (3,)), ("shape", (2, 3, 4)),
    ("chunk_crc32c", np.zeros(1, np.uint32)), ("chunk_crc32c", np.arange(5, dtype=np.uint32)),
    ("chunk_crc32c", np.arange(10, dtype=np.uint32)[::2]),  # not contiguous
    ("chunk_crc32c", np.arange(3, dtype=">u4")),  # big-endian
    ("values", np.arange(4, dtype=np.int64)), ("values", np.linspace(0, 1, 3)),
    ("values", np.array(1.5, np.float32)), ("values", np.array(3, np.int16)),  # 0-d: long way
    ("values", np.arange(6, dtype=np.int8).reshape(2, 3)),
    ("doc", {"a": [1, 2]}),
]


@pytest.mark.parametrize(("key", "value"), VALUES, ids=[f"{k}-{i}" for i, (k, _) in
                                                         enumerate(VALUES)])
def test_row_is_the_general_encoding(key: str, value: Any) -> None:
    """The same name, file type, dataspace, memory type (the very ids) and bytes as
    :func:`encode_attr`, whether the kind's template is new or reused."""
    expected = _row(encode_attr(key, value))
    assert attr_row(key, value) == expected
    assert attr_row(key, value) == expected  # the template reused


def test_row_leaves_the_array_writable() -> None:
    table = np.arange(4, dtype=np.uint32)
    attr_row("chunk_crc32c", table)
    table[0] = 9  # the writer's table stays its own
    assert attr_row("chunk_crc32c", table)[4] == table.tobytes()


RNG = np.random.default_rng(13)
STATE = {
    **{f"layer{i}.w": RNG.standard_normal(16).astype(np.float32) for i in range(5)},
    "f16": RNG.standard_normal((3, 5)).astype(np.float16),
    "f64": np.float64(2.5),  # a scalar
    "i8": np.arange(-4, 4, dtype=np.int8),
    "u64": np.arange(3, dtype=np.uint64),
    "mask": np.array([True, False, True]),
    "z": (RNG.standard_normal(4) + 1j * RNG.standard_normal(4)).astype(np.complex64),
    "multi": RNG.standard_normal((64, 32)).astype(np.float32),  # several chunks: a longer table
    "ünï.cödé": np.ones(2, np.float32),
    "n" * 250: np.zeros(1, np.float32),  # a long name
}


def _without_times(data: bytes) -> bytes:
    """The file's bytes with each version 2 object header's times and its first chunk's
    checksum (which covers them) zeroed. Datasets record none; the root group does where
    h5py's ``File`` records times (before h5py 3.16)."""
    out = bytearray(data)
    at = out.find(b"OHDR")
    while at >= 0:
        flags = out[at + 5]
        if out[at + 4] == 2 and flags & 0x20:
            out[at + 6:at + 22] = bytes(16)
            pos = at + 22 + (4 if flags & 0x10 else 0)
            width = 1 << (flags & 0x03)
            end = pos + width + int.from_bytes(out[pos:pos + width], "little")
            out[end:end + 4] = bytes(4)
        at = out.find(b"OHDR", at + 4)
    return bytes(out)


def _general_write_attrs(oid: Any, attrs: dict[str, Any], *, replace: bool = False) -> None:
    """Every attribute through encode_attr, straight into libhdf5: main's save path."""
    assert not replace
    lib = libhdf5.library()
    assert lib is not None
    rows = [_row(encode_attr(k, v)) for k, v in attrs.items()]
    assert lib.write_attrs(oid.id, rows) == len(rows)


def test_files_are_byte_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if libhdf5.library() is None:
        pytest.fail("libhdf5 is not usable here, so the direct writes go untested")
    fixed = uuid.UUID(int=13)  # one save_id for every save
    monkeypatch.setattr(metadata, "uuid", SimpleNamespace(uuid4=lambda: fixed))

    ls.save(STATE, tmp_path / "rows.h5", chunk_bytes=1024)
    time.sleep(1.0 - time.time() % 1.0 + 0.01)  # the next second: saves' clocks differ
    ls.save(STATE, tmp_path / "rows_again.h5", chunk_bytes=1024)  # templates reused
    with monkeypatch.context() as m:
        m.setattr(hdf5_store, "write_attrs", _general_write_attrs)
        ls.save(STATE, tmp_path / "general.h5", chunk_bytes=1024)
    with monkeypatch.context() as m:
        m.setattr(attrs_module, "library", lambda: None)  # h5py's low-level API
        ls.save(STATE, tmp_path / "h5py.h5", chunk_bytes=1024)
    # the saves' clocks differ: the datasets' headers, and so the root's header digests
    # (which cover them), are the same all the same
    files = {p.stem: _without_times(p.read_bytes()) for p in tmp_path.glob("*.h5")}
    assert files["rows"] == files["general"] == files["h5py"] == files["rows_again"]
    back = ls.load_state(tmp_path / "rows.h5")
    assert back.keys() == STATE.keys()
    for key, value in STATE.items():
        assert np.asarray(back[key]).tobytes() == np.asarray(value).tobytes()


def _dataset_headers_with_times(data: bytes) -> int:
    """How many version 2 object headers of the file but the root group's record times (flag
    bit 5). (The root group's does where h5py's ``File`` records times: before h5py 3.16.)"""
    assert data[:8] == b"\x89HDF\r\n\x1a\n" and data[8] in (2, 3)  # superblock v2/v3
    root = int.from_bytes(data[36:44], "little")  # its root group object header address
    count, at = 0, data.find(b"OHDR")
    while at >= 0:
        count += at != root and data[at + 4] == 2 and bool(data[at + 5] & 0x20)
        at = data.find(b"OHDR", at + 4)
    return count


def test_datasets_record_no_times(tmp_path: Path) -> None:
    path = tmp_path / "c.h5"
    ls.save(STATE, path, chunk_bytes=1024)
    with h5py.File(path, "r") as f:
        assert len(f) == len(STATE)
        for name in f:
            assert f[name].id.get_create_plist().get_obj_track_times() == 0, name
    assert _dataset_headers_with_times(path.read_bytes()) == 0


def test_datasets_with_times_still_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    """A file of before (each dataset's header with its times) loads, by the header path and
    its digests as before, and verifies."""
    monkeypatch.setattr(hdf5_store, "TRACK_TIMES", True)
    path = tmp_path / "c.h5"
    ls.save(STATE, path, chunk_bytes=1024)
    assert _dataset_headers_with_times(path.read_bytes()) == len(STATE)
    with h5py.File(path, "r") as f:
        assert "header_digests" in f.attrs
    back = ls.load_state(path)
    for key, value in STATE.items():
        assert np.asarray(back[key]).tobytes() == np.asarray(value).tobytes()
    assert ls.verify(path).ok
