"""Metadata that grows with the number of tensors is bounded by what the checkpoint holds, not
by a fixed size: a state of many tensors (a mixture-of-experts model saved unfused has ~90,000)
saves and loads, while a document larger than its store can justify is still refused.

A Zarr root repeats every array's document (its consolidated metadata) and adds the layout:
~1.5 KiB per tensor, so 44,000 tensors passed the fixed 64 MiB a metadata document may have,
and such a save committed a checkpoint every load refused ("zarr.json: ... bytes of
metadata"). An HDF5 manifest holds ~350 bytes per tensor (64 MiB at ~190,000 tensors).
Here the fixed limits are lowered to 64 KiB, so that ~200 tensors cross them in a second;
``tools/many_tensors.py`` runs the real sizes (100,000 tensors)."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest

import lean_store as ls
from lean_store import hardening
from lean_store.stores.zarr import checks as zarr_checks

SMALL = 64 << 10
N = 300


def _state() -> dict[str, np.ndarray]:
    return {f"model.layers.{i // 24}.mlp.experts.{i % 24}.weight": np.full((2, 3), i, np.float32)
            for i in range(N)}


@pytest.fixture
def small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardening, "MAX_METADATA_BYTES", SMALL)
    monkeypatch.setattr(zarr_checks, "MAX_METADATA_BYTES", SMALL)
    monkeypatch.setattr(hardening, "MAX_ATTR_BYTES", SMALL)


def _same(path: Path, state: dict[str, np.ndarray]) -> None:
    out = ls.load_state(path)
    assert set(out) == set(state)
    assert all(np.array_equal(out[k], v) for k, v in state.items())
    assert ls.verify(path).ok
    with ls.open(path) as ck:
        assert np.array_equal(ck.read("model.layers.8.mlp.experts.7.weight"),
                              state["model.layers.8.mlp.experts.7.weight"])


def test_a_zarr_root_larger_than_one_document_may_be_loads(tmp_path, small_limits) -> None:
    state = _state()
    path = tmp_path / "many.zarr"
    ls.save(state, path)
    assert os.path.getsize(path / "zarr.json") > SMALL  # the root crossed the fixed limit
    _same(path, state)


def test_a_zarr_root_larger_than_its_arrays_justify_is_refused(tmp_path, small_limits) -> None:
    path = tmp_path / "many.zarr"
    ls.save(_state(), path)
    documents = sum(os.path.getsize(path / d / "zarr.json") for d in os.listdir(path)
                    if (path / d).is_dir())
    limit = hardening.root_document_limit(documents)
    assert os.path.getsize(path / "zarr.json") < limit
    with open(path / "zarr.json", "r+b") as f:  # sparse: nothing is written
        f.truncate(limit + 1)
    with pytest.raises(ls.UnsafeFileError, match="bytes of metadata"):
        ls.load_state(path)
    assert any("bytes of metadata" in str(p) for p in ls.verify(path).problems)


def test_an_array_document_keeps_its_own_limit(tmp_path, small_limits) -> None:
    """Only the root grows with the tensors: one array's document is still bounded alone."""
    path = tmp_path / "many.zarr"
    ls.save(_state(), path)
    with open(path / "model.layers.0.mlp.experts.0.weight" / "zarr.json", "r+b") as f:
        f.truncate(SMALL + 1)
    with pytest.raises(ls.UnsafeFileError, match="bytes of metadata"):
        ls.load_state(path)


def test_incremental_steps_link_against_a_large_root(tmp_path, small_limits) -> None:
    pytest.importorskip("torch")  # training checkpoints (Checkpointer) need torch
    state = _state()
    ck = ls.Checkpointer(tmp_path / "run", backend="zarr", incremental=True)
    first = ck.save(1, model=state, rng=False)
    assert os.path.getsize(first / "zarr.json") > SMALL
    state["model.layers.0.mlp.experts.0.weight"] = np.zeros((2, 3), np.float32)
    path = ck.save(2, model=state, rng=False)
    stats = ck.last_save_stats
    assert stats is not None and stats.linked_files >= N - 1  # the base's root was read
    out = ls.load_state(path)
    assert all(np.array_equal(out[f"model/{k}"], v) for k, v in state.items())
    assert ls.verify(path).ok and ls.verify(first).ok


def test_an_hdf5_manifest_larger_than_one_attribute_may_be_loads(tmp_path,
                                                                  small_limits) -> None:
    state = _state()
    path = tmp_path / "many.h5"
    ls.save(state, path)
    with h5py.File(path) as f:
        assert len(f.attrs["manifest"]) > SMALL  # the manifest crossed the fixed limit
    _same(path, state)


def test_an_hdf5_root_attribute_may_be_as_large_as_its_file() -> None:
    assert hardening.root_attr_limit(10) == hardening.MAX_ATTR_BYTES
    assert hardening.root_attr_limit(5 << 30) == 5 << 30


# ---------------------------------------------- what a load would refuse is never committed


def _linear_model():
    torch = pytest.importorskip("torch")
    return torch.nn.Linear(2, 2)


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_training_metadata_a_load_would_refuse_is_refused_before_writing(
        tmp_path, monkeypatch, suffix) -> None:
    from lean_store.training import state as training_state

    monkeypatch.setattr(training_state, "MAX_META_TEXT", SMALL)
    model = _linear_model()
    path = tmp_path / f"t{suffix}"
    ls.save_training(path, model=model, extra={"epoch": 1})
    with pytest.raises(ls.CheckpointError, match=r"extra= and data=") as info:
        ls.save_training(path, model=model, extra={"history": ["x" * 100] * 1000})
    assert "training metadata" in str(info.value)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left
    assert ls.load_training(path, model=model).extra == {"epoch": 1}  # the previous one kept


def test_a_zarr_root_a_load_would_refuse_is_refused_before_the_commit(tmp_path,
                                                                    small_limits) -> None:
    """Training metadata within its own limit whose quotes, escaped again in the root
    document, take the root past what a load reads: the save fails before its commit."""
    model = _linear_model()
    path = tmp_path / "t.zarr"
    ls.save_training(path, model=model, extra={"epoch": 1})
    quotes = {"notes": ['"' * 100] * 200}  # ~41 KB of metadata, ~82 KB once in the root
    with pytest.raises(ls.CheckpointError, match="root zarr.json would be"):
        ls.save_training(path, model=model, extra=quotes)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert ls.load_training(path, model=model).extra == {"epoch": 1}
    with pytest.raises(ls.CheckpointError, match="root zarr.json would be"):  # through zarr
        ls.save_training(path, model=model, extra=quotes, compression="zstd")
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert ls.load_training(path, model=model).extra == {"epoch": 1}
    ls.save_training(tmp_path / "t.h5", model=model, extra=quotes)  # HDF5: as large as its file
    assert ls.load_training(tmp_path / "t.h5", model=model).extra == quotes


def test_dcp_objects_a_load_would_refuse_are_refused(tmp_path, monkeypatch) -> None:
    pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.api import CheckpointException

    import lean_store.interop.dcp as lsd
    from lean_store.interop.dcp import objects

    monkeypatch.setattr(objects, "MAX_TEXT", SMALL)
    import torch

    path = tmp_path / "d.zarr"
    with pytest.raises(CheckpointException, match=r"'log' \(\d+ characters\)"):
        dcp.save({"w": torch.ones(2), "log": ["x" * 100] * 1000},
                 storage_writer=lsd.StorageWriter(path), no_dist=True)
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no temporary left
