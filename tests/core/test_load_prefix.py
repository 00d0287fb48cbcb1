"""Loading the module saved inside another: a LightningModule's ``self.model``, a wrapper's
submodule. The checkpoint names its tensors ``model.0.weight``; the bare module's are
``0.weight``. torch users strip the prefix from a state dict by hand; ``ls.load(target, path,
prefix="model.")`` and ``ls.load_state(path, prefix="model.")`` read the tensors under the
prefix, the rest of the checkpoint being no concern of the target, and a load without it says
which prefix would match. Before, every name was listed as missing and unexpected."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

import lean_store as ls

BACKENDS = [".h5", ".zarr"]
RNG = np.random.default_rng(5)
WRAPPED = {
    "model.0.weight": RNG.standard_normal((4, 3)).astype(np.float32),
    "model.0.bias": RNG.standard_normal(4).astype(np.float32),
    "model.1.weight": RNG.standard_normal((2, 4)).astype(np.float32),
    "loss_fn.weight": np.ones(2, np.float32),
}


def _bare() -> dict[str, np.ndarray]:
    return {"0.weight": np.zeros((4, 3), np.float32), "0.bias": np.zeros(4, np.float32),
            "1.weight": np.zeros((2, 4), np.float32)}


@pytest.mark.parametrize("suffix", BACKENDS)
def test_load_with_a_prefix(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"w{suffix}"
    ls.save(WRAPPED, path)
    target = _bare()
    with pytest.raises(ls.LayoutError, match="load with prefix='model.'"):
        ls.load(target, path)
    assert not any(v.any() for v in target.values())
    result = ls.load(target, path, prefix="model.")
    assert result.unexpected == [] and len(result.loaded) == 3
    assert all(target[k].tobytes() == WRAPPED["model." + k].tobytes() for k in target)
    state = ls.load_state(path, prefix="model.")
    assert sorted(state) == sorted(target)
    assert all(state[k].tobytes() == target[k].tobytes() for k in state)
    cast = ls.load_state(path, prefix="model.", cast={"0.bias": "float16"})
    assert cast["0.bias"].tobytes() == WRAPPED["model.0.bias"].astype(np.float16).tobytes()
    like = ls.load_state(path, prefix="model.", like=_bare())
    assert sorted(like) == sorted(target)


@pytest.mark.parametrize("suffix", BACKENDS)
def test_strictness_applies_under_the_prefix(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"w{suffix}"
    ls.save(WRAPPED, path)
    bigger = {**_bare(), "2.weight": np.zeros(2, np.float32)}
    with pytest.raises(ls.LayoutError, match="'model.2.weight': missing"):
        ls.load(bigger, path, prefix="model.")
    assert not bigger["0.weight"].any()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        result = ls.load(bigger, path, prefix="model.", strict=False)
    assert result.missing == ["model.2.weight"] and bigger["0.weight"].any()
    with pytest.raises(ls.CheckpointError, match="no tensor whose name starts with 'nothing.'"):
        ls.load(_bare(), path, prefix="nothing.")
    with pytest.raises(ls.CheckpointError, match="prefix must be a string"):
        ls.load_state(path, prefix=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("suffix", BACKENDS)
def test_the_other_way_round_names_the_submodule(tmp_path: Path, suffix: str) -> None:
    """A bare module's checkpoint loaded into the wrapper: the error says the target's names
    have the prefix (load into that submodule)."""
    path = tmp_path / f"b{suffix}"
    bare = _bare()
    ls.save(bare, path)
    wrapper = {"model." + k: v for k, v in _bare().items()}
    with pytest.raises(ls.LayoutError, match="target's names are the checkpoint's with "
                                             "'model.' in front"):
        ls.load(wrapper, path)
