"""Root attributes holding state trees as JSON (a training checkpoint's ``training``, a
checkpoint dict's ``lightning``, DCP's ``dcp``) nested hundreds of thousands of levels deep
are refused with :class:`UnsafeFileError` before the parser recurses into them; they raised
Python's raw ``RecursionError``. A legitimate tree as deep as the codec writes still loads."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from torch_optional import require_torch

torch = require_torch()

import torch.distributed.checkpoint as dcp  # noqa: E402

import lean_store as ls  # noqa: E402
import lean_store.interop.dcp as lsd  # noqa: E402
from lean_store.interop.checkpoint_dict import load_checkpoint_dict  # noqa: E402
from lean_store.interop.convert import convert  # noqa: E402
from lean_store.statetree import MAX_DEPTH  # noqa: E402

DEEP = '{"x":' + "[" * 200_000 + "]" * 200_000 + "}"


def _set(path, key: str, text: str) -> None:
    with h5py.File(path, "a") as f:
        f.attrs.create(key, np.bytes_(text.encode()))


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(2, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_deep_training_attribute_is_refused(tmp_path) -> None:
    model, opt = _model()
    ls.save_training(tmp_path / "t.h5", model=model, optimizer=opt, step=1)
    _set(tmp_path / "t.h5", "training", DEEP)
    with pytest.raises(ls.UnsafeFileError, match="nested 200001 levels deep"):
        ls.load_training(tmp_path / "t.h5", model=model, optimizer=opt)


def test_a_deep_checkpoint_dict_attribute_is_refused(tmp_path) -> None:
    torch.save({"model": {"w": torch.ones(2)}, "epoch": 1}, tmp_path / "c.pt")
    convert(tmp_path / "c.pt", tmp_path / "c.h5")
    _set(tmp_path / "c.h5", "lightning", DEEP)
    with pytest.raises(ls.UnsafeFileError, match="nested 200001 levels deep"):
        load_checkpoint_dict(tmp_path / "c.h5")
    with pytest.raises(ls.UnsafeFileError, match="nested 200001 levels deep"):
        convert(tmp_path / "c.h5", tmp_path / "back.pt")
    assert not (tmp_path / "back.pt").exists()


def test_a_deep_dcp_attribute_is_refused(tmp_path) -> None:
    path = tmp_path / "d.h5"
    dcp.save({"w": torch.ones(3), "step": 4}, storage_writer=lsd.StorageWriter(path),
             no_dist=True)
    _set(path / "lean_store.h5", "dcp", DEEP)  # the master file of the sharded layout
    with pytest.raises(ls.UnsafeFileError, match="nested 200001 levels deep"):
        lsd.StorageReader(path).read_metadata()
    # dcp.load reports it in its own exception, naming it
    with pytest.raises(dcp.api.CheckpointException, match="nested 200001 levels deep"):
        dcp.load({"w": torch.zeros(3), "step": 0}, storage_reader=lsd.StorageReader(path),
                 no_dist=True)


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_the_deepest_tree_the_codec_writes_loads(tmp_path, suffix) -> None:
    tree: object = 7
    for i in range(MAX_DEPTH - 2):  # dicts with int keys: three JSON levels each
        tree = {i: tree}
    model, opt = _model()
    path = tmp_path / f"deep{suffix}"
    ls.save_training(path, model=model, optimizer=opt, step=1, extra={"tree": tree})
    info = ls.load_training(path, model=model, optimizer=opt)
    assert info.extra == {"tree": tree}
    torch.save({"model": {"w": torch.ones(2)}, "tree": tree}, tmp_path / "deep.pt")
    convert(tmp_path / "deep.pt", tmp_path / f"c{suffix}")
    assert load_checkpoint_dict(tmp_path / f"c{suffix}")["tree"] == tree
