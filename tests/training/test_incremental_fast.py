"""Incremental steps' fixed costs: a hard-linked file is not fsynced again (its data became
durable when the step it came from was committed), and the directories of a Zarr tree are made
durable by one ``syncfs`` instead of one fsync each; the commit still happens only after."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from helpers import frozen_backbone_model
from torch_optional import require_torch

import lean_store as ls
from lean_store.stores import commit, fs_sync

torch = require_torch()  # Checkpointer steps hold a torch model




def _record(monkeypatch) -> list[tuple[str, str]]:
    """("fsync" | "syncfs" | "rename", path) in order."""
    events: list[tuple[str, str]] = []
    real_fsync, real_syncfs, real_exchange, real_replace = (
        os.fsync, fs_sync.syncfs, commit._exchange, os.replace)

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def syncfs(path):
        events.append(("syncfs", str(path)))
        return real_syncfs(path)

    real_point_sync = fs_sync.SyncPoint.sync

    def point_sync(self):
        events.append(("syncfs", "sync point"))
        return real_point_sync(self)

    def replace(a, b):
        events.append(("rename", str(b)))
        return real_replace(a, b)

    def exchange(a, b):
        events.append(("rename", str(b)))
        return real_exchange(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(fs_sync, "syncfs", syncfs)
    monkeypatch.setattr(fs_sync.SyncPoint, "sync", point_sync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(commit, "_exchange", exchange)
    return events


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name fds")
def test_linked_files_are_not_fsynced_and_directories_take_one_syncfs(tmp_path, monkeypatch):
    model = frozen_backbone_model()
    ck = ls.Checkpointer(tmp_path / "run", backend="zarr", incremental=True)
    ck.save(0, model=model, rng=False)
    with torch.no_grad():
        model[1].weight.add_(1.0)
    events = _record(monkeypatch)
    path = ck.save(1, model=model, rng=False)
    monkeypatch.undo()
    assert ck.last_save_stats.linked_files > 0
    linked = {str(p.relative_to(path)) for p in path.rglob("*")
              if p.is_file() and p.stat().st_nlink > 1}
    assert linked  # the frozen layer's chunk files
    commit = events.index(("rename", str(path)))
    synced = [p for kind, p in events[:commit] if kind == "fsync"]
    tmp = [p for p in synced if ".lean_store-tmp-" in p]
    names = {p.split(".lean_store-tmp-", 1)[1].split("/", 1)[1] for p in tmp if "/" in
             p.split(".lean_store-tmp-", 1)[1]}
    assert not names & linked  # no linked file fsynced again
    if not fs_sync.REPORTS_ERRORS:  # else one syncfs makes them durable (test_sync_point.py)
        assert any(n.endswith("zarr.json") for n in names)  # written files are
        written = {str(p.relative_to(path)) for p in path.rglob("*")
                   if p.is_file() and p.stat().st_nlink == 1}
        assert written <= names  # every file written by this step was fsynced before the commit
    if fs_sync._SYNCFS is not None:  # Linux: the directories by one syncfs, before the commit
        assert [kind for kind, _ in events[:commit]].count("syncfs") == 1
        assert not [p for p in tmp if Path(p).is_dir()]
    got = ls.load_state(path)
    np.testing.assert_array_equal(got["model/1.weight"], model[1].weight.detach().numpy())
    assert ls.verify(path).ok and ls.verify(ck.path(0)).ok


def test_without_syncfs_every_directory_is_fsynced(tmp_path, monkeypatch):
    monkeypatch.setattr(fs_sync, "_SYNCFS", None)
    monkeypatch.setattr(fs_sync, "REPORTS_ERRORS", False)
    events: list[str] = []
    real = commit._fsync_dir
    monkeypatch.setattr(commit, "_fsync_dir", lambda p: (events.append(str(p)), real(p))[1])
    path = tmp_path / "w.zarr"
    ls.save({"a": np.arange(10.0), "b": np.ones((3, 4), np.float32)}, path)
    dirs = [p for p in path.rglob("*") if p.is_dir()] + [path]
    in_tree = [p for p in events if ".lean_store-tmp-" in p]  # fsynced before the commit
    assert len(in_tree) == len(dirs)
