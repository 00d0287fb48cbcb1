"""A Zarr tree is made durable by one ``syncfs`` on a descriptor opened before the save wrote
anything (Linux 5.8+ reports every writeback error since then), not by one fsync per file."""

from __future__ import annotations

import os

import numpy as np
import pytest

import lean_store as ls
from lean_store.stores import commit, fs_sync


@pytest.mark.parametrize(("release", "reports"), [
    ("5.8.0", True), ("5.7.19-generic", False), ("6.18.44-fc-v669", True), ("4.19.0", False),
    ("10.0", True), ("", False), ("abc", False)])
def test_syncfs_reports_errors_from_linux_5_8(release, reports):
    assert fs_sync._reports_errors(release) is reports


def _state() -> dict[str, np.ndarray]:
    return {"a": np.arange(1000.0), "b": np.ones((30, 40), np.float32)}


@pytest.mark.skipif(not fs_sync.REPORTS_ERRORS or fs_sync._SYNCFS is None,
                    reason="syncfs reports writeback errors on Linux 5.8+ only")
def test_zarr_tree_takes_one_syncfs_opened_before_the_first_write(tmp_path, monkeypatch):
    events: list[str] = []
    real_open, real_sync, real_fsync = fs_sync.open_sync_point, fs_sync.SyncPoint.sync, os.fsync
    path = tmp_path / "m.zarr"

    def open_point(directory):
        # nothing of the save exists yet: every byte it writes comes after this descriptor
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".m.zarr")]
        events.append("open")
        return real_open(directory)

    monkeypatch.setattr(fs_sync, "open_sync_point", open_point)
    monkeypatch.setattr(fs_sync.SyncPoint, "sync", lambda self: (events.append("syncfs"),
                                                                 real_sync(self))[1])
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(
        "fsync " + os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
    ls.save(_state(), path)
    monkeypatch.undo()
    assert events[0] == "open" and events[1] == "syncfs"
    assert not [e for e in events if ".lean_store-tmp-" in e]  # no file of the copy fsynced
    assert [e for e in events[2:] if e.startswith("fsync")] == [f"fsync {tmp_path}"]  # parent
    got = ls.load_state(path)
    np.testing.assert_array_equal(got["b"], _state()["b"])


def test_a_syncfs_error_fails_the_save_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "m.zarr"
    ls.save(_state(), path)

    def failing(self):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(fs_sync.SyncPoint, "sync", failing)
    monkeypatch.setattr(fs_sync, "REPORTS_ERRORS", True)
    if fs_sync._SYNCFS is None:
        pytest.skip("no syncfs here")
    with pytest.raises(OSError):
        ls.save({"a": np.zeros(3)}, path)
    monkeypatch.undo()
    assert sorted(ls.load_state(path)) == ["a", "b"]  # the previous checkpoint, whole
    assert [p.name for p in tmp_path.iterdir()] == ["m.zarr"]  # the temporary is gone


def test_a_tree_of_several_writers_is_fsynced_file_by_file(tmp_path):
    """Sharded saves (ranks maybe on other hosts of a network file system) keep per-file
    fsyncs: one syncfs on rank 0's host would not reach the other hosts' writes."""
    assert commit.Commit.local(tmp_path / "x.zarr", directory=True)._sync is None


def test_a_commit_closes_its_sync_point(tmp_path):
    c = commit.Commit.local(tmp_path / "x.zarr", directory=True, one_writer=True)
    point = c._sync
    c.make_directory()
    c.abort()
    if point is not None:
        assert not point._close.alive
