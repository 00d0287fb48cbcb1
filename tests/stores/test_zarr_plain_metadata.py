"""Zarr per-tensor cost (issue 13): a local store of lean_store's own layout is described from
its root ``zarr.json`` alone, without zarr's metadata objects (stores/zarr/plain.py); its files
are written with one open each; nothing is fsynced on a file system kept in memory."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import numpy as np
import pytest
import zarr
from helpers import flip_bits

import lean_store as ls
from lean_store.stores import commit, fs_sync
from lean_store.stores.zarr import direct_write
from lean_store.stores.zarr.plain import plain_array, plain_members, plain_root

RNG = np.random.default_rng(130)
STATE = {
    "w": RNG.standard_normal((77, 32), dtype=np.float32),  # 10 chunks of 1 KiB: sharded
    "b": RNG.standard_normal(5, dtype=np.float32),
    "i": RNG.integers(-9, 9, (3, 4), dtype=np.int64),
    "c": (RNG.standard_normal(6) + 1j).astype(np.complex64),
    "m": RNG.random(9) > 0.5,
    "empty": np.zeros((0, 3), np.float32),
}


def _saved(tmp_path: Path, **kw) -> Path:
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path, chunk_bytes=1024, **kw)
    return path


def _root(path: Path) -> dict:
    return json.loads((path / "zarr.json").read_text())


def test_load_and_verify_build_no_zarr_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    """Neither opening, reading every tensor nor verify opens the store through zarr."""
    path = _saved(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("the store was opened through zarr")

    monkeypatch.setattr(zarr, "open_group", refuse)
    monkeypatch.setattr(zarr, "open_array", refuse)
    loaded = ls.load_state(path)
    for name, value in STATE.items():
        assert np.array_equal(np.asarray(loaded[name]), value), name
    with ls.open(path) as ck:
        ck.verify()  # raises on any problem
        assert ck.describe("w").codecs == ("ShardingCodec", "BytesCodec", "Crc32cCodec")


def test_every_member_lean_store_writes_is_plain(tmp_path: Path) -> None:
    members = plain_members(plain_root(_root(_saved(tmp_path))))
    assert members is not None and set(members) == set(STATE)
    assert members["w"].shards is not None and members["b"].shards is None
    (tmp_path / "x").mkdir()
    weights = plain_members(plain_root(_root(_saved(tmp_path / "x", compression="weights"))))
    assert weights is not None and all(a.compressed for a in weights.values())


def _edits():
    def sharding(doc):
        return doc["codecs"][0]["configuration"]

    return [
        lambda d: d.update(extra=1),
        lambda d: d.update(data_type="bfloat16"),
        lambda d: d.update(shape=[True, 32]),
        lambda d: d.update(shape=[]),
        lambda d: d.update(dimension_names=None),
        lambda d: d.update(chunk_key_encoding={"name": "v2", "configuration": {"separator": "."}}),
        lambda d: d.update(storage_transformers=[{"name": "x"}]),
        lambda d: sharding(d).update(index_location="start"),
        lambda d: sharding(d)["codecs"].insert(1, {"name": "gzip", "configuration": {"level": 1}}),
        lambda d: sharding(d).update(chunk_shape=[0, 32]),
        lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[64, 64]),  # 2 axes split
        lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[2**40, 32]),  # too big
        lambda d: d["codecs"].append({"name": "crc32c"}),
    ]


@pytest.mark.parametrize("edit", _edits())
def test_other_documents_are_left_to_zarr(tmp_path: Path, edit) -> None:
    doc = _root(_saved(tmp_path))["consolidated_metadata"]["metadata"]["w"]
    assert plain_array("w", copy.deepcopy(doc)) is not None
    changed = copy.deepcopy(doc)
    edit(changed)
    assert plain_array("w", changed) is None


def test_a_foreign_member_sends_the_whole_store_through_zarr(tmp_path: Path) -> None:
    """A member whose document is not the direct layout (here: too large a shard for any
    reader to allocate) is described by zarr, whose checks refuse it."""
    path = _saved(tmp_path)
    root = _root(path)
    for doc in (root["consolidated_metadata"]["metadata"]["w"],):
        doc["chunk_grid"]["configuration"]["chunk_shape"] = [2**40, 32]
    (path / "zarr.json").write_text(json.dumps(root, indent=2))
    own = json.loads((path / "w" / "zarr.json").read_text())
    own["chunk_grid"]["configuration"]["chunk_shape"] = [2**40, 32]
    (path / "w" / "zarr.json").write_text(json.dumps(own, indent=2))
    assert plain_members(plain_root(root)) is None
    with pytest.raises(ls.UnsafeFileError, match="'w'"):
        ls.load_state(path)


def test_tampered_own_document_of_a_plain_array_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    own = json.loads((path / "b" / "zarr.json").read_text())
    own["attributes"]["crc32c"] ^= 1
    (path / "b" / "zarr.json").write_text(json.dumps(own, indent=2))
    with pytest.raises(ls.IntegrityError, match="'b'.*consolidated"):
        ls.load_state(path)
    with ls.open(path) as ck, pytest.raises(ls.IntegrityError, match="'b'"):
        ck.verify()


def test_each_file_opened_once_to_write_on_save(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real = os.open

    def spy(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR):  # writing (the commit's fsyncs open to read)
            opened.append(os.fspath(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    path = _saved(tmp_path)
    monkeypatch.setattr(os, "open", real)
    written = [o.partition(".lean_store-tmp-")[2].partition("/")[2] for o in opened]
    files = [p.relative_to(path).as_posix() for p in path.rglob("*")
             if p.is_file() and p.parent != path]  # every array's files (not the root's)
    assert len(files) >= 2 * len(STATE) - 1  # a document and chunk (shard) files; "empty": none
    for rel in files:
        assert written.count(rel) == 1, rel


def test_write_all_resumes_short_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pieces = [np.arange(7, dtype=np.uint8), b"", b"abcdefghijk", np.arange(3, dtype=np.uint16)]
    want = b"".join(bytes(memoryview(p).cast("B")) for p in pieces)

    def short(fd, buffers):  # at most 5 bytes a call
        return os.write(fd, bytes(buffers[0])[:5])

    monkeypatch.setattr(direct_write.os, "writev", short)
    with open(tmp_path / "f", "wb") as f:
        direct_write.write_all(f.fileno(), pieces)
    assert (tmp_path / "f").read_bytes() == want


def test_chunk_crc_taken_from_the_pipeline(tmp_path: Path) -> None:
    """A whole uncompressed chunk's CRC-32C comes from the caller (the save pipeline computed
    it already), given as a number or as a callable returning it, and is not computed again."""
    from lean_store.chunking import Region

    data = np.arange(16, dtype=np.float32)
    doc = {"chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
           "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                      {"name": "crc32c"}]}
    region: Region = (slice(0, 16),)
    for crc in (0x12345678, lambda: 0x12345678):
        folder = tmp_path / f"a{id(crc)}"
        direct_write.DirectWriter(folder, doc, (16,), None, 4).write(region, data, crc)
        raw = (folder / "c" / "0").read_bytes()  # the document's "/" separator
        assert raw == data.tobytes() + (0x12345678).to_bytes(4, "little")


def _mount_type(path: str) -> str | None:
    best, kind = "", None
    with open("/proc/self/mounts") as f:
        for line in f:
            _dev, point, fstype, *_ = line.split()
            if (path == point or path.startswith(point.rstrip("/") + "/")) \
                    and len(point) > len(best):
                best, kind = point, fstype
    return kind


@pytest.mark.skipif(not Path("/proc/self/mounts").exists(), reason="Linux mount table")
def test_in_memory_file_systems_told_apart(tmp_path: Path) -> None:
    for place in ("/dev/shm", os.fspath(tmp_path)):
        if not Path(place).is_dir():
            continue
        kind = _mount_type(os.path.realpath(place))
        if fs_sync._STATFS is not None:
            assert fs_sync.in_memory(Path(place)) == (kind in ("tmpfs", "ramfs")), place


@pytest.mark.skipif(fs_sync._STATFS is None or _mount_type("/dev/shm") != "tmpfs",
                    reason="needs a tmpfs /dev/shm and statfs")
def test_no_fsync_on_tmpfs_but_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(commit.os, "fsync", lambda fd: synced.append(fd) or real(fd))
    shm = Path("/dev/shm") / f"lean_store-test-{os.getpid()}"
    try:
        shm.mkdir()
        (shm / "f").write_bytes(b"x")
        commit.fsync_tree(shm)
        assert synced == []
    finally:
        (shm / "f").unlink(missing_ok=True)
        shm.rmdir()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x")
    if not fs_sync.in_memory(tmp_path):
        commit.fsync_tree(tmp_path / "d")
        assert synced


BIG = RNG.standard_normal((900, 1024), dtype=np.float32)  # 4 chunks of 1 MiB, the last partial


def _big(tmp_path: Path) -> Path:
    path = tmp_path / "big.zarr"
    ls.save({"x": BIG, "v": STATE["b"]}, path, chunk_bytes=1 << 20)
    return path


def test_digest_follows_from_the_checked_chunk_crcs(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole-tensor read of the direct layout combines the chunks' CRCs (checked as they are
    read, the big chunks on another thread meanwhile) into the digest: no second pass."""
    import lean_store.checkpoint as checkpoint

    path = _big(tmp_path)

    def no_second_pass(*args, **kwargs):
        raise AssertionError("the digest was computed over the data again")

    monkeypatch.setattr(checkpoint, "crc32c_update", no_second_pass)
    loaded = ls.load_state(path)
    assert np.array_equal(np.asarray(loaded["x"]), BIG)
    assert np.array_equal(np.asarray(loaded["v"]), STATE["b"])


@pytest.mark.parametrize("chunk", ["0", "1", "3"])  # full chunks (read unchecked), the edge one
def test_damaged_chunk_refused_on_load(tmp_path: Path, chunk: str) -> None:
    path = _big(tmp_path)
    flip_bits(path / "x" / f"c.{chunk}.0", 1000, 0x40)
    with pytest.raises(ls.IntegrityError, match=rf"'x'.*chunk \({chunk}, 0\).*crc32c"):
        ls.load_state(path)


def test_digest_mismatch_refused(tmp_path: Path) -> None:
    """Chunks intact but the recorded digest altered (in the array's document and its copy
    alike): the digest combined from the chunks' CRCs disagrees."""
    path = _big(tmp_path)
    root = _root(path)
    root["consolidated_metadata"]["metadata"]["x"]["attributes"]["crc32c"] ^= 1
    (path / "zarr.json").write_text(json.dumps(root, indent=2))
    own = json.loads((path / "x" / "zarr.json").read_text())
    own["attributes"]["crc32c"] ^= 1
    (path / "x" / "zarr.json").write_text(json.dumps(own, indent=2))
    with pytest.raises(ls.IntegrityError, match="'x'.*does not match the recorded"):
        ls.load_state(path)


def test_one_folder_per_array(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk keys ``c.0.0.0.0`` (the separator "."): a rank-4 array and a vector each cost
    one ``mkdir``, their chunk files sit in it, and zarr-python reads them."""
    made: list[str] = []
    real = os.mkdir

    def spy(path, *args, **kwargs):
        made.append(os.fspath(path).partition(".lean_store-tmp-")[2][32:])
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", spy)
    state = {"w": np.arange(144, dtype=np.float32).reshape(4, 4, 3, 3),
             "b": np.ones(3, np.float32)}
    ls.save(state, tmp_path / "ck.zarr")
    monkeypatch.setattr(os, "mkdir", real)
    assert [m for m in made if m.count("/") >= 1] == ["/w", "/b"]
    assert sorted(os.listdir(tmp_path / "ck.zarr" / "w")) == ["c.0.0.0.0", "zarr.json"]
    assert np.array_equal(np.asarray(ls.load_state(tmp_path / "ck.zarr")["b"]), np.ones(3))
    group = zarr.open_group(tmp_path / "ck.zarr", mode="r")
    assert np.array_equal(group["w"][...], state["w"])


@pytest.mark.parametrize("size", [0, 5, 65535, 65536, 65537, 200_000])
def test_metadata_read_whole_and_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         size: int) -> None:
    from lean_store.stores.zarr import checks

    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        assert checks.read_bytes_at(fd, "f") == data
        monkeypatch.setattr(checks, "MAX_METADATA_BYTES", 65536)
        if size > 65536:
            with pytest.raises(ls.UnsafeFileError, match="more than 65536 bytes"):
                checks.read_bytes_at(fd, "f")
        else:
            assert checks.read_bytes_at(fd, "f") == data
    finally:
        os.close(fd)
