"""What an analyst's annotation does to a checkpoint (docs/GUIDE.md "Other tools"): a root
attribute written with zarr-python or h5py is ignored (the checkpoint loads and verifies), an
attribute added to a tensor's array or dataset is a change to that tensor's metadata and is
refused, on both backends alike."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr

import lean_store as ls

STATE = {"w": np.arange(6, dtype=np.float32), "b": np.ones((2, 3), np.float16)}


def _annotate_root(path: Path) -> None:
    if path.suffix == ".h5":
        with h5py.File(path, "r+") as f:
            f.attrs["note"] = "good run"
    else:
        zarr.open_group(str(path), mode="r+").attrs["note"] = "good run"


def _annotate_tensor(path: Path) -> None:
    if path.suffix == ".h5":
        with h5py.File(path, "r+") as f:
            f["w"].attrs["reviewed"] = np.int64(1)
    else:
        zarr.open_group(str(path), mode="r+")["w"].attrs["reviewed"] = 1


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_root_annotations_are_ignored(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"x{suffix}"
    ls.save(STATE, path)
    _annotate_root(path)
    got = ls.load_state(path)
    assert all(got[k].tobytes() == v.tobytes() for k, v in STATE.items())
    assert ls.verify(path).ok


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_tensor_annotations_are_refused(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"x{suffix}"
    ls.save(STATE, path)
    _annotate_tensor(path)
    with pytest.raises(ls.IntegrityError, match="'w'"):
        ls.load_state(path)
    assert not ls.verify(path).ok
