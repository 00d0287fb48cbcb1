"""Tensors inside state trees (trainer extras, scheduler and data state, checkpoint dicts) are
named by their key path; a path whose node name does not fit one path component (255 bytes,
a Zarr array being a directory of that name) is shortened to what fits plus a digest of the
whole path, instead of the save being refused as "unsafe tensor names"."""

from __future__ import annotations

import numpy as np
import pytest
from torch_optional import needs_torch, torch

import lean_store as ls
from lean_store.naming import MAX_NODE_BYTES, check_names, node_name
from lean_store.statetree import decode, encode, storable_name

LONG_KEY = "ModelCheckpoint{'monitor': 'val/loss', 'mode': 'min', 'every_n_train_steps': 0}"


@pytest.mark.parametrize("path", [
    "extra/" + "k" * 300,
    f"callbacks/{LONG_KEY}/best_k_models//tmp/run/epoch=3-step=16.ckpt",
    "extra/" + "é" * 200,  # 12 escaped bytes a character
    "x" * 2000,
])
def test_long_paths_become_storable_unique_names(path) -> None:
    name = storable_name(path)
    assert len(node_name(name).encode()) <= MAX_NODE_BYTES
    check_names([name])
    assert name == storable_name(path)  # the same path always gives the same name
    assert storable_name(path + "x") != name
    assert name.split("~")[0] == path[: len(name.split("~")[0])]  # its start kept


def test_short_paths_keep_their_name() -> None:
    assert storable_name("extra/loss") == "extra/loss"
    assert storable_name(f"callbacks/{LONG_KEY}/score") == f"callbacks/{LONG_KEY}/score"


def test_a_tree_with_long_keys_round_trips_through_a_checkpoint(tmp_path, backend) -> None:
    suffix = ".zarr" if backend == "zarr" else ".h5"
    extra = {f"{LONG_KEY}/{'z' * 200}": np.arange(3.0), "short": np.float32(2.5),
             "nested": {"é" * 120: np.ones(2, np.int16)}}
    tensors: dict = {}
    tree = encode(extra, "extra", tensors)
    ls.save(tensors, tmp_path / f"t{suffix}")
    stored = ls.load_state(tmp_path / f"t{suffix}")
    back = decode(tree, lambda kind, name: stored[name][()] if kind == "scalar"
                  else stored[name], "extra")
    assert list(back) == list(extra)
    assert np.array_equal(back[f"{LONG_KEY}/{'z' * 200}"], extra[f"{LONG_KEY}/{'z' * 200}"])
    assert back["short"] == np.float32(2.5)
    assert back["nested"]["é" * 120].dtype == np.int16


@needs_torch
def test_save_training_with_a_long_extra_key(tmp_path, backend) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / ("e.zarr" if backend == "zarr" else "e.h5")
    extra = {LONG_KEY: {"best": torch.tensor(0.25), "paths": {"/tmp/" + "p" * 250: 1.0}}}
    ls.save_training(path, model=model, optimizer=opt, step=1, extra=extra)
    info = ls.load_training(path, model=model, optimizer=opt)
    assert torch.equal(info.extra[LONG_KEY]["best"], torch.tensor(0.25))
    assert info.extra[LONG_KEY]["paths"] == extra[LONG_KEY]["paths"]
