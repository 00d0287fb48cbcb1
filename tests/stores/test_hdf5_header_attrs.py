"""A dataset's attributes compared with its manifest record from its object header's bytes
(stores/hdf5/header.py, header_attrs.py): the fast path accepts exactly the attributes
written, sends every other header to libhdf5's comparison, and a tampered attribute is
still caught on read and by verify."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import h5py
import numpy as np
import pytest

import lean_store as ls
from lean_store.errors import CheckpointError
from lean_store.stores.hdf5 import header_attrs
from lean_store.stores.hdf5 import store as hdf5_store
from lean_store.stores.hdf5.attrs import encode_attr
from lean_store.stores.hdf5.header import attribute_messages, plain_superblock
from lean_store.stores.hdf5.header_attrs import HeaderAttributes
from lean_store.stores.hdf5.libhdf5 import library


@pytest.fixture(autouse=True)
def _no_digest_table(monkeypatch) -> None:
    """The path these tests follow serves files without the save's header digests (written
    before them, or repacked): the table is set aside (test_hdf5_header_digests.py)."""
    monkeypatch.setattr(hdf5_store, "parse_digests", lambda *args: None)


def _state() -> dict[str, np.ndarray]:
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.int64),
            "s": np.array(1.5, np.float64)}


def _saved(tmp_path: Path, name: str = "ck.h5") -> Path:
    path = tmp_path / name
    ls.save(_state(), path)
    return path


def _messages(path: Path, node: str) -> dict:
    lib = library()
    assert lib is not None
    with h5py.File(path, "r") as f:
        fd = f.id.get_vfd_handle()
        dataset = f[node]  # kept open while its id is used
        found = lib.object_header(dataset.id.id)
        assert found is not None
        return attribute_messages(lambda n, at: os.pread(fd, n, at), found[0],
                                  os.fstat(fd).st_size)


def _spy(monkeypatch) -> dict[str, list]:
    """Record what each comparison returned."""
    seen: dict[str, list] = {"header": [], "libhdf5": []}
    header, libhdf5_match = hdf5_store.header_match, hdf5_store.attrs_match

    def spy_header(messages, expected):
        seen["header"].append(header(messages, expected))
        return seen["header"][-1]

    def spy_libhdf5(oid, expected):
        seen["libhdf5"].append(libhdf5_match(oid, expected))
        return seen["libhdf5"][-1]

    monkeypatch.setattr(hdf5_store, "header_match", spy_header)
    monkeypatch.setattr(hdf5_store, "attrs_match", spy_libhdf5)
    return seen


def test_the_header_holds_every_attribute_as_written(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    with h5py.File(path, "r") as f:
        assert plain_superblock(os.pread(f.id.get_vfd_handle(), 48, 0))
        attrs = dict(f["w"].attrs)
    messages = _messages(path, "w")
    assert sorted(messages) == sorted(k.encode() for k in attrs)
    for key, value in attrs.items():
        if key == "chunk_crc32c":
            raw = np.asarray(value, np.uint32).tobytes()
        else:
            raw = encode_attr(key, ls.stores.hdf5.checks.from_hdf5_attr(value)).raw
        assert messages[key.encode()][2].startswith(raw)


def test_a_second_load_takes_the_header_path(tmp_path: Path, monkeypatch) -> None:
    first, second = _saved(tmp_path, "a.h5"), _saved(tmp_path, "b.h5")
    ls.load_state(first)  # libhdf5 confirms the encodings at the latest here
    seen = _spy(monkeypatch)
    got = ls.load_state(second)
    assert seen["header"] == [True, True, True] and seen["libhdf5"] == []
    for name, value in _state().items():
        assert got[name].tobytes() == value.tobytes()


def _tamper(path: Path, key: str, change) -> None:
    """Rewrite attribute ``key`` of "b" the way the writer writes attributes (version 3
    attribute messages: the kind the header path reads)."""
    with h5py.File(path, "r+", libver=("v108", "v108")) as f:
        attrs = f["b"].attrs
        value = attrs[key]
        del attrs[key]
        attrs[key] = change(value)


CHANGED = [  # another value: an IntegrityError naming the attribute
    ("index", lambda v: np.int64(v + 1)),
    ("shape", lambda v: np.asarray(v) + 1),
    ("name", lambda v: np.array(b"c", dtype=h5py.string_dtype("utf-8", 1))),
    ("crc32c", lambda v: np.int64(v ^ 1)),
    ("chunk_crc32c", lambda v: np.asarray(v) ^ np.uint32(1)),
]
RETYPED = [  # the same value under another type: read value by value, and it passes
    ("index", lambda v: np.uint64(v)),  # the same bytes, unsigned
    ("index", lambda v: np.int32(v)),
    ("shape", lambda v: np.asarray(v).astype(np.int32)),
    ("name", lambda v: np.array(v, dtype=h5py.string_dtype("ascii", len(v)))),  # charset
    ("chunk_crc32c", lambda v: np.asarray(v).astype(np.int64)),
]


@pytest.mark.parametrize("key, change", CHANGED)
def test_a_tampered_attribute_is_caught_with_the_header_path_on(
    tmp_path: Path, monkeypatch, key: str, change
) -> None:
    clean, path = _saved(tmp_path, "clean.h5"), _saved(tmp_path)
    ls.load_state(clean)  # every kind of attribute confirmed: the header path is on
    _tamper(path, key, change)
    seen = _spy(monkeypatch)
    read = HeaderAttributes.attribute_messages
    parsed: list = []
    monkeypatch.setattr(HeaderAttributes, "attribute_messages", lambda self, dsid, n: (
        parsed.append(read(self, dsid, n)), parsed[-1])[1])
    with pytest.raises(CheckpointError, match=key):
        ls.load_state(path)
    assert None not in parsed  # every header was read, the tampered one too,
    assert False in seen["header"]  # and it did not match
    assert not ls.verify(path).ok


@pytest.mark.parametrize("key, change", RETYPED)
def test_a_retyped_attribute_goes_to_libhdf5(tmp_path: Path, monkeypatch, key: str,
                                             change) -> None:
    clean, path = _saved(tmp_path, "clean.h5"), _saved(tmp_path)
    ls.load_state(clean)
    _tamper(path, key, change)
    seen = _spy(monkeypatch)
    got = ls.load_state(path)  # docs/FORMAT.md 2.5.1, 3.: equal values under another type
    assert seen["header"].count(False) == 1 and seen["libhdf5"] == [False]
    assert got["b"].tobytes() == _state()["b"].tobytes()


@pytest.mark.parametrize("how", ["extra", "missing"])
def test_an_added_or_removed_attribute_is_caught(tmp_path: Path, monkeypatch, how: str) -> None:
    clean, path = _saved(tmp_path, "clean.h5"), _saved(tmp_path)
    ls.load_state(clean)
    with h5py.File(path, "r+") as f:
        if how == "extra":
            f["w"].attrs["note"] = 1
        else:
            del f["w"].attrs["bias"]
    seen = _spy(monkeypatch)
    with pytest.raises(CheckpointError, match="note" if how == "extra" else "bias"):
        ls.load_state(path)
    assert False in seen["header"]


def test_bytes_changed_inside_the_header_are_caught(tmp_path: Path) -> None:
    clean, path = _saved(tmp_path, "clean.h5"), _saved(tmp_path)
    ls.load_state(clean)
    messages = _messages(path, "b")
    data = path.read_bytes()
    raw = struct.pack("<q", 1)  # the index of "b" in the layout
    at = data.find(b"index\0")
    assert at > 0 and raw == messages[b"index"][2][:8]
    spot = data.index(messages[b"index"][1][-8:] + raw, at) + 8  # "index"'s data
    damaged = bytearray(data)
    damaged[spot] ^= 0x01
    path.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError):
        ls.load_state(path)


def test_many_datasets_agree_with_the_libhdf5_comparison(tmp_path: Path, monkeypatch) -> None:
    """Every dataset the header path accepts, libhdf5 accepts too (and the reverse)."""
    rng = np.random.default_rng(1)
    state = {f"layer{i}.{k}": rng.standard_normal(n, dtype=np.float32)
             for i in range(12) for k, n in (("weight", 33), ("bias", 3))}
    path = tmp_path / "many.h5"
    ls.save(state, path)
    ls.load_state(path)
    seen = _spy(monkeypatch)
    spy_header = hdf5_store.header_match  # then always asks libhdf5 as well
    monkeypatch.setattr(hdf5_store, "header_match", lambda m, e: spy_header(m, e) and False)
    got = ls.load_state(path)
    assert seen["header"] == [True] * len(state)
    assert seen["libhdf5"] == [True] * len(state)
    assert all(got[k].tobytes() == v.tobytes() for k, v in state.items())


def _header(messages: list[tuple[int, int, bytes]]) -> bytes:
    """A version 2 object header chunk 0 holding ``messages`` (type, flags, body)."""
    body = b"".join(struct.pack("<BHB", t, len(b), fl) + b for t, fl, b in messages)
    return b"OHDR\x02\x02" + struct.pack("<I", len(body)) + body + b"\0\0\0\0"


def _attr(name: bytes, data: bytes, flags: int = 0) -> bytes:
    dtype = b"\x10\x08\x00\x00\x08\x00\x00\x00\x00\x00\x40\x00"  # int64 little endian
    space = b"\x02\x00\x00\x00"  # scalar
    return struct.pack("<BBHHHB", 3, flags, len(name) + 1, len(dtype), len(space), 0) + (
        name + b"\0" + dtype + space + data)


def _parse(header: bytes) -> dict | None:
    return attribute_messages(lambda n, at: header[at:at + n], 0, len(header))


def test_the_parser_reads_only_the_headers_it_knows() -> None:
    one = _attr(b"index", struct.pack("<q", 3))
    found = _parse(_header([(0x0C, 0, one)]))
    assert found is not None and found[b"index"][2] == struct.pack("<q", 3)
    compact = b"\x00\x00" + b"\xff" * 16
    assert _parse(_header([(0x15, 0, compact), (0x0C, 0, one)])) is not None
    dense = b"\x00\x00" + struct.pack("<Q", 4096) + b"\xff" * 8  # a fractal heap
    assert _parse(_header([(0x15, 0, dense), (0x0C, 0, one)])) is None
    assert _parse(_header([(0x0C, 0x02, one)])) is None  # a shared message
    assert _parse(_header([(0x0C, 0, one), (0x0C, 0, one)])) is None  # a name twice
    assert _parse(_header([(0x0C, 0, _attr(b"index", b"", flags=1))])) is None
    assert _parse(_header([(0x0C, 0, one)])[:-12]) is None  # truncated
    assert _parse(b"OHDR\x01" + _header([(0x0C, 0, one)])[5:]) is None  # version 1
    far = struct.pack("<QQ", 1 << 40, 64)  # a continuation past the end of the file
    assert _parse(_header([(0x10, 0, far), (0x0C, 0, one)])) is None


def test_superblocks_with_a_base_address_are_not_read() -> None:
    good = b"\x89HDF\r\n\x1a\n" + bytes([2, 8, 8, 0]) + struct.pack("<QQQQ", 0, 0, 100, 48)
    assert plain_superblock(good)
    assert not plain_superblock(good[:8] + bytes([0]) + good[9:])  # version 0
    assert not plain_superblock(good[:12] + struct.pack("<Q", 512) + good[20:])
    assert not plain_superblock(good[:9] + bytes([4]) + good[10:])  # 4-byte addresses


def test_where_headers_cannot_be_read_libhdf5_compares(tmp_path: Path, monkeypatch) -> None:
    path = _saved(tmp_path)
    ls.load_state(path)
    seen = _spy(monkeypatch)
    monkeypatch.setattr(header_attrs, "plain_superblock", lambda head: False)
    got = ls.load_state(path)
    assert seen["header"] == [False] * 3 and seen["libhdf5"] == [True] * 3
    assert got["w"].tobytes() == _state()["w"].tobytes()


def test_known_message_bytes_are_taken_unparsed_and_anything_else_is_parsed() -> None:
    one = _attr(b"index", struct.pack("<q", 3))
    prefix = one[:-8]  # version, flags, sizes, name, datatype, dataspace
    whole = struct.pack("<BHB", 0x0C, len(one), 0) + one
    known = {whole: (b"index", (0, prefix, struct.pack("<q", 3)))}

    def parse(header: bytes) -> dict | None:
        return attribute_messages(lambda n, at: header[at:at + n], 0, len(header), None, known)

    assert parse(_header([(0x0C, 0, one)])) == _parse(_header([(0x0C, 0, one)]))
    other = _attr(b"index", struct.pack("<q", 4))  # another value: parsed, not taken
    found = parse(_header([(0x0C, 0, other)]))
    assert found is not None and found[b"index"][2] == struct.pack("<q", 4)
    assert parse(_header([(0x0C, 0, one), (0x0C, 0, one)])) is None  # a name twice
    assert parse(_header([(0x0C, 0, one), (0x0C, 0, other)])) is None
    assert parse(_header([(0x0C, 0x02, one)])) is None  # shared: other bytes, parsed, refused


def test_a_clean_load_takes_every_attribute_message_by_its_bytes(tmp_path: Path,
                                                                 monkeypatch) -> None:
    """Once libhdf5 confirmed each kind of attribute, a clean file's attribute messages are
    all found by their whole bytes (made from the manifest record), none parsed."""
    first, second = _saved(tmp_path, "a.h5"), _saved(tmp_path, "b.h5")
    ls.load_state(first)
    lookups = {"hit": 0, "miss": 0}

    class Counting(dict):
        def get(self, key, default=None):
            found = dict.get(self, key, default)
            lookups["hit" if found is not None else "miss"] += 1
            return found

    made = header_attrs.known_messages
    monkeypatch.setattr(hdf5_store, "known_messages", lambda expected: Counting(made(expected)))
    seen = _spy(monkeypatch)
    got = ls.load_state(second)
    assert seen["header"] == [True, True, True] and seen["libhdf5"] == []
    with h5py.File(second, "r") as f:
        assert lookups == {"hit": sum(len(f[k].attrs) for k in f), "miss": 0}
    for name, value in _state().items():
        assert got[name].tobytes() == value.tobytes()
