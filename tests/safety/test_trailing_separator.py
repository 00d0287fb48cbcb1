"""A path string ending in "/" names what it names without it, as pathlib takes it: a save to
"run.h5/" wrote run.h5, but loading, opening, verifying or converting "run.h5/" failed with
"cannot inspect run.h5/: Not a directory". The same string now reaches the same checkpoint
everywhere."""

from __future__ import annotations

import numpy as np
import pytest

import lean_store as ls
from lean_store.cli import main


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_one_string_saves_and_reads_the_same_checkpoint(tmp_path, suffix, capsys) -> None:
    path = f"{tmp_path}/run{suffix}/"
    ls.save({"a": np.arange(4.0)}, path)
    assert (tmp_path / f"run{suffix}").exists()
    assert np.array_equal(ls.load_state(path)["a"], np.arange(4.0))
    with ls.open(path) as ck:
        assert ck["a"][1:3].tolist() == [1.0, 2.0]
    assert ls.verify(path).ok
    target = {"a": np.zeros(4)}
    ls.load(target, path + "/")
    assert target["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert main(["verify", path]) == 0
    assert main(["convert", path, f"{tmp_path}/copy.safetensors"]) == 0
    assert main(["diff", path, f"{tmp_path}/copy.safetensors"]) == 0
    capsys.readouterr()
