"""Atomic commit: temp sibling + fsync + rename; readers never accept an uncommitted copy."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
import zarr

import lean_store as ls
from lean_store.stores import commit, fs_sync
from lean_store.stores.registry import open_writer


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((64, 32)).astype(np.float32),
        "b": rng.integers(0, 1000, 50).astype(np.int64),
    }


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes() for k in a
    )


def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".lean_store-" in p.name)


def test_failed_overwrite_keeps_previous_checkpoint(tmp_path, backend, suffix, monkeypatch):
    path = tmp_path / f"ck{suffix}"
    ls.save(_state(1), path, chunk_bytes=1024)
    from lean_store.stores.hdf5.store import HDF5TensorWriter
    from lean_store.stores.zarr.store import ZarrTensorWriter

    cls = HDF5TensorWriter if backend == "hdf5" else ZarrTensorWriter
    calls = {"n": 0}
    real = cls.write

    def failing(self, region, bits, crc=None):
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("disk on fire")
        return real(self, region, bits, crc)

    monkeypatch.setattr(cls, "write", failing)
    # small HDF5 chunks of host tensors are written behind in batches, not by write
    monkeypatch.setattr(cls, "small_later", False, raising=False)
    with pytest.raises(RuntimeError, match="disk on fire"):
        ls.save(_state(2), path, chunk_bytes=1024)
    monkeypatch.undo()
    assert _same(ls.load_state(path), _state(1))
    assert _leftovers(tmp_path) == []  # the aborted temporary copy was removed


def test_overwrite_replaces_and_leaves_nothing_behind(tmp_path, suffix):
    path = tmp_path / f"ck{suffix}"
    ls.save(_state(1), path)
    ls.save(_state(2), path)
    assert _same(ls.load_state(path), _state(2))
    assert _leftovers(tmp_path) == []
    assert ls.verify(path).ok


def test_directory_swap_without_renameat2_still_commits(tmp_path, monkeypatch):
    monkeypatch.setattr(commit, "_exchange", lambda a, b: False)
    path = tmp_path / "ck.zarr"
    ls.save(_state(1), path)
    ls.save(_state(2), path)
    assert _same(ls.load_state(path), _state(2))
    assert _leftovers(tmp_path) == []


def test_uncommitted_temporary_copy_is_rejected(tmp_path, backend, suffix):
    """A writer that never committed: its temp sibling exists and is refused as incomplete."""
    path = tmp_path / f"ck{suffix}"
    source = ls.sources.tensor_source(_state(3))
    writer = open_writer(path, backend, chunk_bytes=4096, compression=None)
    try:
        for entry, tensor in source.tensors():
            attrs = ls.metadata.tensor_attrs(entry, "raw")
            sink = writer.add_tensor(entry, attrs)
            for region in ls.chunking.iter_regions(entry.shape or (1,), sink.write_unit):
                sink.write(region, tensor.read(region))
            sink.close({"crc32c": 0})
        if backend == "hdf5":
            writer._file.flush()  # everything but the root attributes is on disk
        assert writer.tmp_path.name.startswith(f".{path.name}.lean_store-tmp-")
        assert not path.exists()
        with pytest.raises(ls.IntegrityError):
            ls.open(writer.tmp_path)
    finally:
        writer.abort()
    assert _leftovers(tmp_path) == []


def test_missing_commit_marker_is_incomplete(tmp_path, backend, suffix):
    path = tmp_path / f"ck{suffix}"
    ls.save(_state(4), path)
    if backend == "hdf5":
        with h5py.File(path, "r+") as f:
            del f.attrs["complete"]
    else:
        group = zarr.open_group(str(path), mode="r+")
        attrs = dict(group.attrs)
        del attrs["complete"]
        group.attrs.clear()
        group.attrs.update(attrs)
    with pytest.raises(ls.IntegrityError, match="incomplete checkpoint"):
        ls.load_state(path)
    report = ls.verify(path)
    assert not report.ok and "incomplete" in str(report)


def test_fsync_before_rename_and_parent_after(tmp_path, backend, suffix, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename
    real_exchange = commit._exchange

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("rename", str(b)))
        return real_replace(a, b)

    def exchange(a, b):
        events.append(("rename", str(b)))
        return real_exchange(a, b)

    real_point_sync = fs_sync.SyncPoint.sync

    def point_sync(self):  # a whole Zarr tree, by one syncfs (Linux 5.8+: test_sync_point.py)
        events.append(("fsync", str(tmp_path / f".{path.name}.lean_store-tmp-(syncfs)")))
        return real_point_sync(self)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(commit, "_exchange", exchange)
    monkeypatch.setattr(fs_sync.SyncPoint, "sync", point_sync)
    path = tmp_path / f"ck{suffix}"
    ls.save(_state(1), path)
    ls.save(_state(2), path)  # the overwrite path (directory exchange for zarr)
    monkeypatch.undo()
    renames = [i for i, e in enumerate(events) if e == ("rename", str(path))]
    assert len(renames) == 2
    last = renames[-1]
    synced_before = [p for kind, p in events[:last] if kind == "fsync"]
    synced_after = [p for kind, p in events[last:] if kind == "fsync"]
    tmp_prefix = str(tmp_path / f".{path.name}.lean_store-tmp-")
    assert any(p.startswith(tmp_prefix) for p in synced_before)  # data durable before rename
    if backend == "zarr" and not fs_sync.REPORTS_ERRORS:
        assert sum(p.startswith(tmp_prefix) for p in synced_before) > 3  # every file and dir
    assert str(tmp_path) in synced_after  # the rename itself made durable
    del real_rename


def test_refuses_to_replace_a_directory_with_a_file_and_vice_versa(tmp_path):
    (tmp_path / "dir.h5").mkdir()
    with pytest.raises(ls.CheckpointError):
        ls.save(_state(1), tmp_path / "dir.h5")
    (tmp_path / "file.zarr").write_text("x")
    with pytest.raises(ls.CheckpointError):
        ls.save(_state(1), tmp_path / "file.zarr")
    assert (tmp_path / "file.zarr").read_text() == "x"
    assert _leftovers(tmp_path) == []
