"""The walk of a local Zarr store (issue 13): entry types from the directory listing, a size
read only where asked (a ``zarr.json`` in the walk, bounded; a chunk file when a check needs
it), and a one-chunk array's file length checked by its read and by ``check_metadata``
instead of on open. What the walk finds and refuses is what the walk that ``lstat``-ed every
file found and refused; a short or long chunk file is still a typed error naming its tensor,
in every read, in ``verify`` and in ``load`` before anything is installed."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers import zarr_chunk_files

import lean_store as ls
from lean_store.checkpoint import Checkpoint
from lean_store.errors import IntegrityError, UnsafeFileError
from lean_store.hardening import MAX_METADATA_BYTES, MAX_TREE_DEPTH, file_kind, link_inside
from lean_store.replacement import PinnedRoot
from lean_store.stores.zarr.checks import LocalTree, read_bytes_at, scan_local_zarr
from lean_store.stores.zarr.plain import PlainArray


def _old_walk(root: Path) -> dict[str, int]:
    """The walk as it was before sizes were read lazily: ``lstat`` of every non-directory
    (the reference the new walk is compared with)."""
    files: dict[str, int] = {}
    if not (root / "zarr.json").exists():
        return files
    pending = [("", 0)]
    base = os.fspath(root)
    while pending:
        prefix, depth = pending.pop()
        try:
            with os.scandir(f"{base}/{prefix}" if prefix else base) as listing:
                entries = list(listing)
        except OSError as exc:
            raise IntegrityError(f"{prefix or '.'}: unreadable directory ({exc})") from None
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                key = prefix + entry.name
                if depth + 1 > MAX_TREE_DEPTH:
                    raise UnsafeFileError(
                        f"{key}: directories nested more than {MAX_TREE_DEPTH} deep inside the "
                        "checkpoint; no lean_store writer makes them"
                    )
                pending.append((key + "/", depth + 1))
                continue
            info = entry.stat(follow_symlinks=False)
            mode = info.st_mode
            if not stat.S_ISREG(mode):
                key = prefix + entry.name
                if stat.S_ISLNK(mode):
                    raise UnsafeFileError(link_inside(key, entry.path))  # its message
                if stat.S_ISDIR(mode):
                    raise IntegrityError(f"{key}: changed while the checkpoint was read")
                raise UnsafeFileError(f"{key}: {file_kind(mode)} inside the checkpoint")
            size = info.st_size
            if size > MAX_METADATA_BYTES and entry.name == "zarr.json":
                raise UnsafeFileError(f"{prefix}zarr.json: {size} bytes of metadata")
            files[prefix + entry.name] = size
    return files


def _sizes(tree: LocalTree) -> dict[str, int]:
    return {key: tree.size(key) for key in tree.files}


def _state(n: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    state = {f"t{i:02d}": rng.standard_normal(5 + i).astype(np.float32) for i in range(n)}
    state["mat"] = rng.standard_normal((6, 7)).astype(np.float32)
    state["scalar"] = np.float64(2.5)
    return state


STORES = {
    "plain": ({}, {}),
    "multi-chunk and sharded": ({"chunk_bytes": 1024}, {"rows": np.arange(4000, dtype=np.int32),
                                                       "few": np.arange(1500, dtype=np.int32)}),
    "weights": ({"compression": "weights"}, {}),
    "zstd (through zarr)": ({"compression": "zstd"}, {}),
}


@pytest.mark.parametrize("store", list(STORES))
def test_walk_finds_what_the_old_walk_found(tmp_path: Path, store: str) -> None:
    options, extra = STORES[store]
    path = tmp_path / "w.zarr"
    ls.save({**_state(), **extra}, path, **options)  # type: ignore[arg-type]
    (path / "stray.txt").write_bytes(b"not lean_store's")  # any regular file is listed
    (path / "empty").mkdir()
    old = _old_walk(path)
    tree = scan_local_zarr(path)
    assert set(tree.files) == set(old)
    assert _sizes(tree) == old
    for node in ("t00", "mat", "scalar", "rows", "few", "empty", "nothing"):
        assert sorted(tree.under(node)) == sorted(k for k in old if k.startswith(node + "/"))
    with Checkpoint(path) as ck:  # sizes on disk, read when asked
        for name in ck:
            node = ck.stored(name).node
            want = sum(v for k, v in old.items() if k.startswith(node + "/"))
            assert ck.describe(name).stored_bytes == want


def test_walk_reads_no_chunk_size_and_open_stats_no_one_chunk_file(tmp_path: Path) -> None:
    path = tmp_path / "n.zarr"
    ls.save(_state(), path)
    tree = scan_local_zarr(path)
    assert {k for k, v in tree.files.items() if v is not None} == {
        k for k in tree.files if k.endswith("zarr.json")}
    with Checkpoint(path) as ck:
        files = ck._reader._tree.files  # type: ignore[attr-defined]
        assert [k for k, v in files.items() if v is not None and not k.endswith("zarr.json")] \
            == []  # every tensor here is one chunk: its length is left to its read
        ck.check_metadata("t01")  # what a load without verify runs first: one lstat
        assert files["t01/c.0"] == (path / "t01" / "c.0").stat().st_size


def _make_link_file(root: Path) -> None:
    (root / "link").symlink_to(root / "zarr.json")


def _make_link_dir(root: Path) -> None:
    (root / "t00" / "c2").symlink_to(root / "t01" / "c", target_is_directory=True)


def _make_dangling(root: Path) -> None:
    (root / "t00" / "gone").symlink_to(root / "no-such-file")


def _make_chunk_link(root: Path) -> None:
    chunk = root / "t00" / "c.0"
    chunk.unlink()
    chunk.symlink_to("/etc/passwd")


def _make_array_dir_link(root: Path) -> None:
    os.rename(root / "t01", root.parent / "outside")
    (root / "t01").symlink_to(root.parent / "outside", target_is_directory=True)


def _make_fifo(root: Path) -> None:
    os.mkfifo(root / "t00" / "pipe")


def _make_deep(root: Path) -> None:
    deep = root.joinpath(*["d"] * (MAX_TREE_DEPTH + 1))
    deep.mkdir(parents=True)


def _make_huge_document(root: Path) -> None:
    with open(root / "t02" / "zarr.json", "r+b") as f:  # sparse: nothing written
        f.truncate(MAX_METADATA_BYTES + 1)


def _make_huge_stray_document(root: Path) -> None:
    (root / "junk").mkdir()
    with open(root / "junk" / "zarr.json", "wb") as f:
        f.truncate(MAX_METADATA_BYTES + 1)


def _make_big_chunk_named_like_metadata(root: Path) -> None:
    with open(root / "t00" / "zarr.jso", "wb") as f:  # not a document: any size
        f.truncate(MAX_METADATA_BYTES + 1)


ODD = {
    "symlinked file": (_make_link_file, UnsafeFileError),
    "symlinked directory": (_make_link_dir, UnsafeFileError),
    "dangling symlink": (_make_dangling, UnsafeFileError),
    "chunk symlinked to /etc/passwd": (_make_chunk_link, UnsafeFileError),
    "array directory symlinked outside": (_make_array_dir_link, UnsafeFileError),
    "fifo": (_make_fifo, UnsafeFileError),
    "directories too deep": (_make_deep, UnsafeFileError),
    "over-large array document": (_make_huge_document, UnsafeFileError),
    "over-large stray document": (_make_huge_stray_document, UnsafeFileError),
    "big file that is no document": (_make_big_chunk_named_like_metadata, None),
}


@pytest.mark.parametrize("odd", list(ODD))
def test_odd_entries_handled_as_before(tmp_path: Path, odd: str) -> None:
    make, error = ODD[odd]
    path = tmp_path / "o.zarr"
    ls.save(_state(), path)
    make(path)
    if error is None:
        assert _sizes(scan_local_zarr(path)) == _old_walk(path)
        return
    with pytest.raises(error) as old:
        _old_walk(path)
    with pytest.raises(error) as new:
        scan_local_zarr(path)
    assert str(new.value) == str(old.value)
    with pytest.raises(error):
        ls.load_state(path)
    assert not ls.verify(path).ok


def test_walk_through_a_pin_reads_each_array_document(tmp_path: Path) -> None:
    """With the pinned root, the walk reads each array's ``zarr.json`` (its bytes kept, its
    size the bytes read) instead of ``lstat``-ing it: sizes as the old walk found them."""
    path = tmp_path / "p.zarr"
    ls.save(_state(), path)
    pin = PinnedRoot(path)
    try:
        tree = scan_local_zarr(path, pin)
        assert _sizes(tree) == _old_walk(path)
    finally:
        pin.close()
    assert tree.documents == {d.name: (d / "zarr.json").read_bytes()
                              for d in path.iterdir() if d.is_dir()}
    assert "" not in tree.documents  # the root's own document is read by the open, bounded


def test_document_read_never_blocks_on_a_fifo(tmp_path: Path) -> None:
    """A FIFO in place of a document (swapped in after the walk listed a file) opens without
    blocking and reads as empty: a parse error, not a hang."""
    os.mkfifo(tmp_path / "zarr.json")
    fd = os.open(tmp_path, os.O_RDONLY)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(read_bytes_at(fd, "zarr.json")),
                              daemon=True)
    try:
        reader.start()
        reader.join(10)
        blocked = reader.is_alive()
        if blocked:  # release it: a writer opens the other end
            os.close(os.open(tmp_path / "zarr.json", os.O_WRONLY))
    finally:
        os.close(fd)
    assert not blocked
    assert got == [b""]


def test_lazy_size_of_a_file_gone_or_replaced(tmp_path: Path) -> None:
    path = tmp_path / "g.zarr"
    ls.save(_state(), path)
    tree = scan_local_zarr(path)
    (path / "t00" / "c.0").unlink()
    with pytest.raises(IntegrityError, match="t00/c.0"):
        tree.size("t00/c.0")
    (path / "t01" / "c.0").unlink()
    (path / "t01" / "c.0").symlink_to(path / "zarr.json")
    with pytest.raises(IntegrityError, match="t01/c.0: changed"):
        tree.size("t01/c.0")
    with pytest.raises(KeyError):
        tree.size("t02/c.9")  # not a file the walk found


def _damage(chunk: Path, how: str) -> None:
    data = chunk.read_bytes()
    if how == "truncated":
        chunk.write_bytes(data[:-3])
    elif how == "empty":
        chunk.write_bytes(b"")
    else:
        chunk.write_bytes(data + b"\0\0")


DAMAGE = ["truncated", "empty", "extended"]


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_one_chunk_file_named_in_every_read(tmp_path: Path, how: str) -> None:
    path = tmp_path / "r.zarr"
    ls.save(_state(), path)
    _damage(path / "mat" / "c.0.0", how)
    with Checkpoint(path) as ck:  # the open no longer stats it
        with pytest.raises(IntegrityError, match="'mat'"):
            ck.read("mat")
        with pytest.raises(IntegrityError, match="'mat'"):
            ck.read_region("mat", (slice(1, 3), slice(2, 5)))
        with pytest.raises(IntegrityError, match="'mat'"):
            ck["mat"][0]
        with pytest.raises(IntegrityError, match="'mat'"):
            list(ck.blocks("mat"))
        with pytest.raises(IntegrityError, match="'mat'"):
            ck.check_metadata("mat")
        with pytest.raises(IntegrityError, match="'mat'"):
            ck.verify()
        np.testing.assert_array_equal(ck.read("t00"), _state()["t00"])  # the others read
    with pytest.raises(IntegrityError, match="'mat'"):
        ls.load_state(path)
    report = ls.verify(path)
    assert not report.ok and report.bad_tensors == ["mat"]


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("verify", [False, True])
def test_damaged_last_tensor_fails_the_load_before_the_first_is_installed(
        tmp_path: Path, how: str, verify: bool) -> None:
    state = _state(40)
    names = list(state)
    path = tmp_path / "v.zarr"
    ls.save(state, path)
    last = names[-1]  # "scalar": loaded last
    _damage(path / last / "c.0", how)
    target = {n: np.zeros_like(np.asarray(v)) for n, v in state.items()}
    before = {n: v.copy() for n, v in target.items()}
    with pytest.raises(IntegrityError, match=repr(last)):
        ls.load(target, path, verify=verify)
    for name in names:
        np.testing.assert_array_equal(target[name], before[name])
    undamaged = tmp_path / "ok.zarr"  # the same load of an undamaged copy goes through
    ls.save(state, undamaged)
    ls.load(target, undamaged, verify=verify)
    for name in names:
        np.testing.assert_array_equal(target[name], state[name])


def test_tampered_last_document_fails_a_load_without_verify_before_any_install(
        tmp_path: Path) -> None:
    state = _state(10)
    path = tmp_path / "d.zarr"
    ls.save(state, path)
    own = path / "scalar" / "zarr.json"
    doc = json.loads(own.read_text())
    doc["attributes"]["name"] = "other"
    own.write_text(json.dumps(doc, indent=2))
    target = {n: np.zeros_like(np.asarray(v)) for n, v in state.items()}
    with pytest.raises(IntegrityError, match="disagrees with its copy"):
        ls.load(target, path, verify=False)
    for name in state:
        assert not np.any(target[name])


@pytest.mark.parametrize("count, sharded", [(1500, False), (4000, True)])
def test_multi_chunk_files_still_sized_on_open(tmp_path: Path, count: int,
                                               sharded: bool) -> None:
    path = tmp_path / "m.zarr"
    ls.save({"rows": np.arange(count, dtype=np.int32), "v": np.ones(3, np.float32)}, path,
            chunk_bytes=1024)
    doc = json.loads((path / "rows" / "zarr.json").read_text())
    assert (doc["codecs"][0]["name"] == "sharding_indexed") == sharded
    chunks = zarr_chunk_files(path / "rows")
    assert len(chunks) > 1
    chunks[0].write_bytes(chunks[0].read_bytes()[:-1])
    with pytest.raises(IntegrityError, match="'rows'.*truncated"):
        Checkpoint(path)


@pytest.mark.parametrize("shape, chunks, shards, compressed, want", [
    ((5,), (5,), None, False, ("n/c.0", 5 * 4 + 4)),
    ((2, 3), (4, 8), None, False, ("n/c.0.0", 4 * 8 * 4 + 4)),  # a chunk beyond the array
    ((5,), (5,), None, True, None),  # compressed: no exact size
    ((10, 4), (3, 4), None, False, None),  # several chunks: sized on open
    ((64, 2), (8, 2), (32, 2), False, None),  # sharded: sized on open
    ((0, 3), (1, 3), None, False, None),  # empty: no file
])
def test_length_checked_file(shape: tuple[int, ...], chunks: tuple[int, ...],
                             shards: tuple[int, ...] | None, compressed: bool,
                             want: tuple[str, int] | None) -> None:
    array = PlainArray("n", {}, shape, np.dtype("float32"), chunks, shards, compressed)
    assert array.length_checked_file == want
