"""A file of another format handed to ``load``/``load_state``/``open``: the refusal says what it
is and the way to use it with lean_store, and that way works (``lean-store convert`` of a
safetensors or torch file, also a safetensors file named ``.bin``; a zipped Zarr store through
``zarr.storage.ZipStore``; a Hugging Face model directory). An ``.npz`` or any other zip archive
is never taken for a torch file."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import zarr
from torch_optional import needs_torch, torch

import lean_store as ls
from lean_store.interop.convert import convert, format_of_path
from lean_store.interop.foreign import file_kind

STATE = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(3, np.float32)}


def _safetensors(tmp_path: Path, name: str = "model.safetensors") -> Path:
    """A safetensors file written by lean_store's own writer (no safetensors package)."""
    ls.save(STATE, tmp_path / "src.h5")
    out = tmp_path / name
    convert(tmp_path / "src.h5", out, dst_format="safetensors")
    return out


def _refusal(path: Path) -> str:
    with pytest.raises(ls.IntegrityError) as info:
        ls.load_state(path)
    with pytest.raises(ls.IntegrityError, match="not a lean_store checkpoint"):
        ls.open(path)
    return str(info.value)


def _same(state: dict) -> None:
    assert state.keys() == STATE.keys()
    for name, value in STATE.items():
        np.testing.assert_array_equal(np.asarray(state[name]), value)


@pytest.mark.parametrize("name", ["model.safetensors", "weights.bin"])
def test_safetensors_file_named_and_converted(tmp_path: Path, name: str) -> None:
    """Also named ``.bin``: recognised by its header, and ``convert`` reads it as safetensors
    (it took any ``.bin`` for a torch file)."""
    path = _safetensors(tmp_path, name)
    message = _refusal(path)
    assert "it is a safetensors file" in message
    assert f"lean-store convert {path} OUT.h5" in message
    assert format_of_path(path, reading=True) == "safetensors"
    convert(path, tmp_path / "out.h5")
    _same(ls.load_state(tmp_path / "out.h5"))


def test_zipped_zarr_store_named_and_read_through_a_zip_store(tmp_path: Path) -> None:
    ls.save(STATE, tmp_path / "ck.zarr")
    archive = Path(shutil.make_archive(str(tmp_path / "ck.zarr"), "zip", tmp_path / "ck.zarr"))
    message = _refusal(archive)
    assert "zipped Zarr store" in message and "zarr.storage.ZipStore" in message
    store = zarr.storage.ZipStore(archive, mode="r")
    try:
        _same(ls.load_state(store))
    finally:
        store.close()


def test_npz_named_and_not_taken_for_torch(tmp_path: Path) -> None:
    path = tmp_path / "arrays.npz"
    np.savez(path, **STATE)
    assert "numpy .npz archive" in _refusal(path)
    assert file_kind(path) == "npz"
    with pytest.raises(ls.CheckpointError, match="cannot tell the file format"):
        format_of_path(path, reading=True)  # was "torch": a torch.load of an npz followed


def test_other_zip_and_unknown_files_get_no_hint(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("notes")
    archive = Path(shutil.make_archive(str(tmp_path / "docs"), "zip", tmp_path,
                                       "notes.txt"))
    junk = tmp_path / "junk.bin"
    junk.write_bytes(bytes(100))
    for path in (archive, junk, tmp_path / "notes.txt"):
        message = _refusal(path)
        assert message.endswith("and not a Zarr directory)"), message


def test_model_directory_named_and_converted(tmp_path: Path) -> None:
    model = tmp_path / "hf-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    _safetensors(tmp_path, "model.safetensors").rename(model / "model.safetensors")
    with pytest.raises(ls.IntegrityError) as info:
        ls.load_state(model)
    assert "holds model weights (model.safetensors)" in str(info.value)
    assert f"lean-store convert {model} OUT.h5" in str(info.value)
    convert(model, tmp_path / "out.zarr")
    _same(ls.load_state(tmp_path / "out.zarr"))


@needs_torch
@pytest.mark.parametrize("legacy", [False, True])
def test_torch_file_named_and_converted(tmp_path: Path, legacy: bool) -> None:
    assert torch is not None
    path = tmp_path / "model.pt"
    torch.save({k: torch.from_numpy(v) for k, v in STATE.items()}, path,
               _use_new_zipfile_serialization=not legacy)
    message = _refusal(path)
    assert "it is a torch.save file" in message and "weights_only=True" in message
    with pytest.raises(ls.IntegrityError, match="torch.save file"):
        ls.load(torch.nn.Linear(4, 3), path)
    convert(path, tmp_path / "out.h5")
    _same(ls.load_state(tmp_path / "out.h5"))


def test_dcp_directory_named(tmp_path: Path) -> None:
    """A directory torch.distributed.checkpoint's FileSystemWriter wrote (its pickled
    ``.metadata`` and ``*.distcp`` files; only their names are looked at)."""
    dcp_dir = tmp_path / "step-100"
    dcp_dir.mkdir()
    (dcp_dir / ".metadata").write_bytes(b"\x80\x04")
    (dcp_dir / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(ls.IntegrityError) as info:
        ls.load_state(dcp_dir)
    message = str(info.value)
    assert "torch.distributed.checkpoint (DCP) directory" in message
    assert "dcp_to_torch_save" in message and "lean_store.interop.dcp" in message


@needs_torch
def test_dcp_directory_converted_as_the_refusal_says(tmp_path: Path) -> None:
    assert torch is not None
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = {k: torch.from_numpy(v.copy()) for k, v in STATE.items()}
    with warnings.catch_warnings():  # DCP without a process group: "a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")))
    with pytest.raises(ls.IntegrityError, match="DCP"):
        ls.load_state(tmp_path / "dcp")
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "state.pt"))
    convert(tmp_path / "state.pt", tmp_path / "out.h5")
    _same(ls.load_state(tmp_path / "out.h5"))
