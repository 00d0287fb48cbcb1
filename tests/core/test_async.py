"""Async save: the file holds the state as of the call while training mutates it; writer
failures surface on wait()."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from torch_optional import needs_torch, torch

import lean_store as ls
from lean_store.errors import CheckpointError, IntegrityError
from lean_store.stores.hdf5.store import HDF5TensorWriter
from lean_store.stores.zarr.store import ZarrTensorWriter

WRITERS = {".h5": HDF5TensorWriter, ".zarr": ZarrTensorWriter}


def _gate_writes(monkeypatch, writer_cls) -> tuple[threading.Event, threading.Event]:
    """Hold the background writer at its first write until the test lets it go."""
    started, release = threading.Event(), threading.Event()
    original = writer_cls.write

    def write(self, region, bits, crc=None):
        started.set()
        assert release.wait(30), "test never released the writer"
        return original(self, region, bits, crc)

    monkeypatch.setattr(writer_cls, "write", write)
    # small HDF5 chunks of host tensors are written behind in batches, not by write
    monkeypatch.setattr(writer_cls, "small_later", False, raising=False)
    return started, release


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))


@needs_torch
@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_training_mutates_while_the_snapshot_is_written(tmp_path, monkeypatch, suffix) -> None:
    model = _model()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    started, release = _gate_writes(monkeypatch, WRITERS[suffix])
    path = tmp_path / f"ck{suffix}"
    handle = ls.save(model, path, blocking=False)
    assert isinstance(handle, ls.SaveHandle)
    assert started.wait(30) and not handle.done()  # the writer is mid-save
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):  # training goes on, changing every parameter in place
        opt.zero_grad()
        model(torch.randn(16, 64)).square().sum().backward()
        opt.step()
    assert not torch.equal(model[0].weight, expected["0.weight"])
    release.set()
    layout = handle.wait(timeout=60)
    assert handle.done() and handle.exception() is None
    assert layout.names() == list(expected)
    back = ls.load_state(path, like=model)
    for name, value in expected.items():
        assert torch.equal(back[name], value), name


def test_without_snapshot_the_file_sees_mutations(tmp_path, monkeypatch) -> None:
    """The control for the test above: snapshot='none' does not copy, so a mutation lands."""
    state = {"w": np.zeros(1000, np.float32)}
    started, release = _gate_writes(monkeypatch, HDF5TensorWriter)
    handle = ls.save_async(state, tmp_path / "ck.h5", snapshot="none")
    assert started.wait(30)
    state["w"] += 1
    release.set()
    handle.wait(60)
    import h5py

    with h5py.File(tmp_path / "ck.h5", "r") as f:
        assert (f["w"][:] == 1).all()  # the mutation reached the file...
    with ls.open(tmp_path / "ck.h5") as ck, pytest.raises(IntegrityError, match="chunk_crc32c"):
        ck["w"][:]  # ...after its chunk's crc32c was taken: even a partial read catches it
    with pytest.raises(IntegrityError):  # and so does the digest
        ls.load_state(tmp_path / "ck.h5")


@needs_torch
@pytest.mark.parametrize("snapshot", ["device", "host", "auto"])
def test_snapshot_modes_copy_numpy_and_torch(tmp_path, snapshot) -> None:
    state = {"a": torch.arange(10, dtype=torch.int64), "b": np.full(5, 7, np.int16)}
    handle = ls.save_async(state, tmp_path / "ck.zarr", snapshot=snapshot)
    state["a"] += 100
    state["b"][:] = 0
    handle.wait(60)
    back = ls.load_state(tmp_path / "ck.zarr")
    np.testing.assert_array_equal(back["a"], np.arange(10))
    np.testing.assert_array_equal(back["b"], np.full(5, 7, np.int16))


def test_writer_failure_surfaces_on_wait(tmp_path, monkeypatch) -> None:
    def broken(self, region, bits, crc=None):
        raise OSError("disk full")

    monkeypatch.setattr(HDF5TensorWriter, "write", broken)
    monkeypatch.setattr(HDF5TensorWriter, "small_later", False)  # not in batches: by write
    path = tmp_path / "ck.h5"
    handle = ls.save_async({"w": np.ones(100, np.float64)}, path)
    with pytest.raises(OSError, match="disk full"):
        handle.wait(60)
    assert handle.done() and isinstance(handle.exception(), OSError)
    assert list(tmp_path.iterdir()) == []  # no checkpoint and no temporary left behind


def test_bad_input_raises_at_the_call(tmp_path) -> None:
    with pytest.raises(CheckpointError):
        ls.save_async({"w": np.ones(3)}, tmp_path / "missing" / "ck.h5")
    with pytest.raises(CheckpointError):
        ls.save_async({"w": np.ones(3)}, tmp_path / "ck.h5", snapshot="sometimes")
    with pytest.raises(CheckpointError):
        ls.save_async({}, tmp_path / "ck.h5")
    with pytest.raises(CheckpointError):
        ls.save_async({"w": np.ones(3)}, tmp_path / "ck.bin")


def test_wait_timeout_and_context_manager(tmp_path, monkeypatch) -> None:
    started, release = _gate_writes(monkeypatch, HDF5TensorWriter)
    handle = ls.save_async({"w": np.ones(10)}, tmp_path / "ck.h5")
    assert started.wait(30)
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0.05)
    assert "running" in repr(handle)
    release.set()
    with handle:
        pass
    assert handle.done() and (tmp_path / "ck.h5").is_file()


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_relative_path_means_the_directory_of_the_call(tmp_path, monkeypatch, suffix) -> None:
    """A background save of ``"ck.h5"`` writes where the working directory was when it was
    called, whatever the directory when it commits: the checkpoint landed in the new working
    directory (over whatever was there) when the caller changed it before the save ended."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    state = {f"t{i}": np.full((200, 100), i, np.float64) for i in range(20)}
    monkeypatch.chdir(first)
    handle = ls.save(state, f"ck{suffix}", blocking=False)
    monkeypatch.chdir(second)
    handle.wait()
    assert [p.name for p in first.iterdir()] == [f"ck{suffix}"]
    assert list(second.iterdir()) == []
    got = ls.load_state(first / f"ck{suffix}")
    assert all(np.array_equal(got[k], v) for k, v in state.items())


@needs_torch
def test_a_checkpointer_keeps_the_directory_it_was_made_with(tmp_path, monkeypatch) -> None:
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    ck = ls.Checkpointer("run", keep_last=2)
    model = torch.nn.Linear(2, 2)
    ck.save(0, model=model, rng=False)
    monkeypatch.chdir(tmp_path / "elsewhere")
    for step in (1, 2):
        ck.save(step, model=model, rng=False)
    ck.finish_deletions()
    assert ck.steps() == [1, 2] and ck.directory == tmp_path / "run"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        ck.path(1).name, ck.path(2).name]
    assert list((tmp_path / "elsewhere").iterdir()) == []
