"""A node another tool adds to a checkpoint is reported on both backends alike.

An HDF5 dataset outside the root manifest has always been refused by ``load`` and reported by
``verify`` ("not in the layout"). zarr-python's ``create_array`` / ``create_group`` on a
lean_store Zarr store leaves the root's consolidated metadata as it was, and the reader, which
opens a local store from that metadata alone, did not see the new node: ``verify`` said OK.
The walk of the tree that refuses links sees every folder, so the node is now reported the
same way; its own files are never read. A stray folder without a ``zarr.json`` is no node.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr

import lean_store as ls

STATE = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(3, np.float16)}
NOT_IN_LAYOUT = "dataset 'extra' is not in the layout"


def _add_array(path: Path, backend: str) -> None:
    if backend == "hdf5":
        with h5py.File(path, "r+") as f:
            f.create_dataset("extra", data=np.ones(3, np.float32))
    else:
        group = zarr.open_group(path, mode="r+", use_consolidated=False)
        group.create_array("extra", shape=(3,), dtype="float32")


@pytest.mark.parametrize("backend", ["hdf5", "zarr"])
def test_an_added_array_is_refused_by_load_and_reported_by_verify(
        tmp_path: Path, backend: str) -> None:
    path = tmp_path / f"ck.{'h5' if backend == 'hdf5' else 'zarr'}"
    ls.save(STATE, path)
    _add_array(path, backend)
    with pytest.raises(ls.IntegrityError, match=NOT_IN_LAYOUT):
        ls.load_state(path)
    report = ls.verify(path)
    assert not report.ok
    assert NOT_IN_LAYOUT in str(report)


def test_an_added_zarr_group_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path)
    zarr.open_group(path, mode="r+", use_consolidated=False).create_group("notes")
    report = ls.verify(path)
    assert not report.ok and "dataset 'notes' is not in the layout" in str(report)


def test_reconsolidated_after_adding_is_still_refused(tmp_path: Path) -> None:
    """zarr.consolidate_metadata lists the new array in the root: refused as before."""
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path)
    _add_array(path, "zarr")
    with warnings.catch_warnings():  # (zarr warns that consolidated metadata is no spec)
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(path)
    with pytest.raises(ls.IntegrityError, match=NOT_IN_LAYOUT):
        ls.load_state(path)


def test_files_that_are_no_node_change_nothing(tmp_path: Path) -> None:
    """A folder without a zarr.json, or a file at the root, is not a node: the checkpoint
    still loads exactly."""
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path)
    (path / "scratch").mkdir()
    (path / "scratch" / "notes.txt").write_text("kept by a user")
    (path / "README").write_text("a file at the root")
    out = ls.load_state(path)
    for name, value in STATE.items():
        np.testing.assert_array_equal(out[name], value)
    assert ls.verify(path).ok


def test_the_save_over_it_replaces_the_added_node(tmp_path: Path) -> None:
    """The path is a lean_store checkpoint: a save over it writes the state alone."""
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path)
    _add_array(path, "zarr")
    ls.save(STATE, path)
    assert not (path / "extra").exists()
    assert ls.verify(path).ok
