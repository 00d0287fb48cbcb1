"""A checkpoint removed while it is being opened (a step another process's Checkpointer pruned
between a listing and an open): a typed error, never Python's raw ``FileNotFoundError``, which
``ls.verify`` and ``ls.load_state`` raised when the file vanished between the existence check
and the signature read (seen in tests/training/test_shared_directory.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import lean_store as ls
import lean_store.stores.hdf5.backend as hdf5_backend


@pytest.fixture
def vanishing(monkeypatch, tmp_path):
    path = tmp_path / "step.h5"
    ls.save({"a": np.arange(3.0)}, path)
    read_signature = hdf5_backend.hdf5_superblock_offset

    def removed_first(p):
        if os.path.exists(path):
            os.remove(path)
        return read_signature(p)

    monkeypatch.setattr(hdf5_backend, "hdf5_superblock_offset", removed_first)
    return path


def test_verify_reports_a_checkpoint_that_vanished_while_opened(vanishing) -> None:
    report = ls.verify(vanishing)
    assert not report.ok and "does not exist" in str(report)


def test_load_state_raises_a_checkpoint_error_for_it(vanishing) -> None:
    with pytest.raises(ls.CheckpointError, match="the path does not exist"):
        ls.load_state(vanishing)


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_removed_after_it_was_recognised_is_gone_not_damaged(monkeypatch, tmp_path,
                                                            suffix) -> None:
    """Removed between the backend's recognition and its reader's open (a later moment than
    the fixture's): "does not exist" (CheckpointError; the CLI's exit 2), not "not a readable
    HDF5 file" (IntegrityError: damage, exit 1), as a reader racing a pruning Checkpointer saw
    it on HDF5 about once in 50 verifies."""
    import dataclasses
    import shutil

    from lean_store.stores import registry

    path = tmp_path / f"step{suffix}"
    ls.save({"a": np.arange(3.0)}, path)
    record = registry.backend_record(registry.detect_backend(path))

    def removed_first(p, **kwargs):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        return record.reader(p, **kwargs)

    vanishing = dataclasses.replace(record, reader=removed_first)
    monkeypatch.setattr(registry, "backend_record", lambda name: vanishing)
    with pytest.raises(ls.CheckpointError, match="the path does not exist") as info:
        ls.open(path)
    assert not isinstance(info.value, ls.IntegrityError)
