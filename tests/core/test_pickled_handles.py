"""An open checkpoint and its tensor handles can be pickled: a Dataset holding ``ls.open(path)``
goes to a DataLoader's workers under the spawn or forkserver start methods (macOS' default,
and Linux's from Python 3.14), where pickling raised h5py's "h5py objects cannot be pickled".
The unpickled handle opens the checkpoint again by its path, as it was meant when opened, and
refuses to read another save that replaced it meanwhile (CheckpointReplacedError)."""

from __future__ import annotations

import multiprocessing
import os
import pickle

import numpy as np
import pytest
from torch_optional import needs_torch

import lean_store as ls

SUFFIXES = [".h5", ".zarr"]
STATE = {"w": np.arange(600, dtype=np.float32).reshape(20, 30),
         "b": np.arange(7, dtype=np.int64)}


def _rows(handle: ls.TensorHandle, start: int) -> np.ndarray:
    return np.asarray(handle[start:start + 3])


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_pickled_checkpoint_reads_the_same_tensors(tmp_path, suffix) -> None:
    path = tmp_path / f"ck{suffix}"
    ls.save(STATE, path)
    with ls.open(path) as ck:
        again = pickle.loads(pickle.dumps(ck))
        handle = pickle.loads(pickle.dumps(ck["w"]))
    try:
        assert np.array_equal(again["b"][...], STATE["b"])
        assert np.array_equal(handle[4:9, 2], STATE["w"][4:9, 2])
    finally:
        again.close()


def test_spawned_workers_read_through_pickled_handles(tmp_path) -> None:
    paths = [tmp_path / f"ck{s}" for s in SUFFIXES]
    handles = []
    for path in paths:
        ls.save(STATE, path)
        handles.append(ls.open(path)["w"])
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        got = pool.starmap(_rows, [(h, r) for h in handles for r in (0, 10, 17)])
    want = [STATE["w"][r:r + 3] for _ in paths for r in (0, 10, 17)]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_handle_unpickled_after_a_newer_save_refuses_it(tmp_path, suffix) -> None:
    path = tmp_path / f"ck{suffix}"
    ls.save(STATE, path)
    with ls.open(path) as ck:
        data = pickle.dumps(ck["w"])
    ls.save({"w": np.zeros((20, 30), np.float32), "b": STATE["b"]}, path)  # replaced
    with pytest.raises(ls.CheckpointReplacedError, match="pickled"):
        pickle.loads(data)


def test_a_relative_path_is_the_one_meant_when_opened(tmp_path, monkeypatch) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    ls.save(STATE, tmp_path / "run" / "ck.h5")
    ls.save({"x": np.ones(1)}, tmp_path / "elsewhere" / "ck.h5")
    monkeypatch.chdir(tmp_path / "run")
    with ls.open("ck.h5") as ck:
        data = pickle.dumps(ck)
    os.chdir(tmp_path / "elsewhere")
    with pickle.loads(data) as again:
        assert sorted(again) == ["b", "w"]


def test_what_cannot_be_opened_again_is_refused_by_name(tmp_path) -> None:
    path = tmp_path / "ck.h5"
    ls.save(STATE, path)
    ck = ls.open(path)
    ck.close()
    with pytest.raises(ls.CheckpointError, match="closed"):
        pickle.dumps(ck)
    with open(path, "rb") as f, ls.open(f) as from_file:
        with pytest.raises(ls.CheckpointError, match="BufferedReader cannot be pickled"):
            pickle.dumps(from_file)


class _Rows:
    """A map-style dataset over one stored tensor's rows."""

    def __init__(self, handle: ls.TensorHandle) -> None:
        self.handle = handle

    def __len__(self) -> int:
        return self.handle.shape[0]

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(self.handle[i])


@needs_torch
def test_a_dataloader_with_spawned_workers(tmp_path) -> None:
    import torch

    path = tmp_path / "ck.zarr"
    ls.save(STATE, path)
    with ls.open(path) as ck:
        loader = torch.utils.data.DataLoader(_Rows(ck["w"]), batch_size=5, num_workers=1,
                                             multiprocessing_context="spawn")
        got = torch.cat(list(loader)).numpy()
    assert np.array_equal(got, STATE["w"])
