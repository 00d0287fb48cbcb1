"""SaveOptions: one options object for every save verb (save, save_async, the training verbs,
Checkpointer), and a single-process path honours each option or raises naming it. The sharded
path's options: test_save_options_sharded.py."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from torch_optional import require_torch

import lean_store as ls
from lean_store import CheckpointError, SaveOptions

ROWS, COLS = 64, 256


def state() -> dict[str, np.ndarray]:
    return {"w": np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS),
            "b": np.arange(7, dtype=np.int64)}


def zarr_codecs(path: Path, node: str = "w") -> list[str]:
    doc = json.loads((path / node / "zarr.json").read_text())
    names = [c["name"] for c in doc["codecs"]]
    for c in doc["codecs"]:
        names += [inner["name"] for inner in c.get("configuration", {}).get("codecs", [])]
    return names


# --------------------------------------------------------------------- the options object


def test_save_options_is_a_frozen_root_export() -> None:
    opts = SaveOptions(chunk_bytes=8192)
    assert ls.SaveOptions is SaveOptions and "SaveOptions" in ls.__all__
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.chunk_bytes = 4096  # type: ignore[misc]
    assert opts.replace(compression="gzip") == SaveOptions(chunk_bytes=8192, compression="gzip")


@pytest.mark.parametrize("bad, field", [
    ({"chunk_bytes": 100}, "chunk_bytes"),
    ({"chunk_bytes": "4096"}, "chunk_bytes"),
    ({"buffer_bytes": 0}, "buffer_bytes"),
    ({"snapshot": "gpu"}, "snapshot"),
    ({"checksum": 32}, "checksum"),
    ({"storage_options": "anon"}, "storage_options"),
])
def test_bad_options_name_the_field(bad: dict, field: str) -> None:
    with pytest.raises(CheckpointError, match=field):
        SaveOptions(**bad)


def test_one_progress_default_for_every_verb() -> None:
    """``save`` and the training verbs share SaveOptions' default (None: a bar on a terminal
    for big jobs only); training saves used to default to False on their own."""
    import inspect

    assert SaveOptions().progress is None
    for verb in (ls.save, ls.save_training, ls.save_optimizer, ls.Checkpointer.save):
        default = inspect.signature(verb).parameters.get("progress")
        assert default is None or default.default is None, verb


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_options_and_keywords_write_the_same_checkpoint(tmp_path: Path, suffix: str) -> None:
    ls.save(state(), tmp_path / f"kw{suffix}", chunk_bytes=8192)
    ls.save(state(), tmp_path / f"opt{suffix}", options=SaveOptions(chunk_bytes=8192))
    with ls.open(tmp_path / f"kw{suffix}") as a, ls.open(tmp_path / f"opt{suffix}") as b:
        assert a["w"].chunks == b["w"].chunks == (8, COLS)


def test_a_field_given_both_ways_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="chunk_bytes given both"):
        ls.save(state(), tmp_path / "x.h5", options=SaveOptions(chunk_bytes=8192),
                chunk_bytes=4096)
    assert not (tmp_path / "x.h5").exists()
    # different fields combine
    ls.save(state(), tmp_path / "y.zarr", options=SaveOptions(chunk_bytes=8192),
            compression="gzip")
    assert "gzip" in zarr_codecs(tmp_path / "y.zarr")
    with ls.open(tmp_path / "y.zarr") as ck:
        assert ck["w"].chunks == (8, COLS)


def test_options_must_be_save_options(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="SaveOptions"):
        ls.save(state(), tmp_path / "x.h5", options={"chunk_bytes": 8192})  # type: ignore[arg-type]


def test_snapshot_on_a_blocking_save_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="snapshot is not supported by blocking saves"):
        ls.save(state(), tmp_path / "x.h5", snapshot="host")
    assert not (tmp_path / "x.h5").exists()


def test_storage_options_on_a_background_save_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="storage_options"):
        ls.save(state(), tmp_path / "x.zarr", blocking=False,
                options=SaveOptions(storage_options={"anon": True}))


def test_save_async_takes_options(tmp_path: Path) -> None:
    handle = ls.save_async(state(), tmp_path / "a.zarr",
                           options=SaveOptions(chunk_bytes=8192, compression="gzip"))
    assert isinstance(handle, ls.SaveHandle)
    handle.wait()
    assert "gzip" in zarr_codecs(tmp_path / "a.zarr")
    with ls.open(tmp_path / "a.zarr") as ck:
        assert ck["w"].chunks == (8, COLS)


# ------------------------------------------------------------------------ training saves


def _model_and_optimizer():
    torch = require_torch()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    return model, opt


def test_training_saves_take_chunk_bytes_and_checksum(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    path = tmp_path / "t.h5"
    ls.save_training(path, model=model, optimizer=opt, step=3, chunk_bytes=4096,
                     checksum="fletcher32+crc32c")
    with h5py.File(path, "r") as f:
        weight = f["model%2Fweight"]
        assert weight.fletcher32 and weight.chunks == (16, 64)
    info = ls.load_training(path, model=model, optimizer=opt)
    assert info.step == 3


def test_save_optimizer_takes_options(tmp_path: Path) -> None:
    _, opt = _model_and_optimizer()
    path = tmp_path / "o.zarr"
    ls.training.save_optimizer(opt, path, options=SaveOptions(compression="gzip"))
    names = [p.name for p in path.iterdir() if p.is_dir()]
    assert any("gzip" in zarr_codecs(path, n) for n in names)


def test_training_save_in_the_background(tmp_path: Path) -> None:
    torch = require_torch()
    model, opt = _model_and_optimizer()
    expected = model.weight.detach().clone()
    handle = ls.save_training(tmp_path / "t.zarr", model=model, optimizer=opt, step=1,
                              blocking=False, snapshot="host")
    assert isinstance(handle, ls.SaveHandle)
    with torch.no_grad():
        model.weight.fill_(7.0)  # after the snapshot: not in the checkpoint
    handle.wait()
    ls.load_training(tmp_path / "t.zarr", model=model, optimizer=opt)
    assert torch.equal(model.weight, expected)


def test_training_save_takes_exactly_the_save_options(tmp_path: Path) -> None:
    """The training verbs and Checkpointer take each SaveOptions field as a keyword."""
    import inspect

    fields = {f.name for f in dataclasses.fields(SaveOptions)}
    never = {ls.save_async: {"storage_options"},  # background saves refuse it
             ls.Checkpointer.__init__: {"snapshot"}, ls.Checkpointer.save: {"snapshot"}}
    for verb in (ls.save, ls.save_async, ls.save_training, ls.save_optimizer,
                 ls.Checkpointer.__init__, ls.Checkpointer.save):
        assert fields - never.get(verb, set()) <= set(inspect.signature(verb).parameters), verb


def test_training_progress_draws_on_the_stream_given(tmp_path: Path) -> None:
    model, _ = _model_and_optimizer()
    stream = io.StringIO()
    ls.save_training(tmp_path / "t.h5", model=model, options=SaveOptions(progress=stream))
    assert "save t.h5" in stream.getvalue()


def test_checkpointer_options_apply_to_every_step(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    ckr = ls.Checkpointer(tmp_path / "run", backend="zarr",
                          options=SaveOptions(compression="gzip", chunk_bytes=4096))
    first = ckr.save(1, model=model, optimizer=opt)
    second = ckr.save(2, model=model, optimizer=opt, compression="zstd")  # overrides one field
    third = ckr.save(3, model=model, optimizer=opt, options=SaveOptions())  # replaces them all
    assert "gzip" in _all_codecs(first)
    assert "zstd" in _all_codecs(second) and "gzip" not in _all_codecs(second)
    assert not {"gzip", "zstd"} & set(_all_codecs(third))
    with ls.open(second) as ck:
        assert ck["model/weight"].chunks == (16, 64)
    with pytest.raises(CheckpointError, match="compression given both"):
        ckr.save(4, model=model, options=SaveOptions(compression="gzip"), compression="zstd")
    with pytest.raises(CheckpointError, match="snapshot"):
        ls.Checkpointer(tmp_path / "run2", options=SaveOptions(snapshot="host"))


def _all_codecs(path: Path) -> list[str]:
    return [name for node in path.iterdir() if (node / "zarr.json").exists() and node.is_dir()
            for name in zarr_codecs(path, node.name)]
