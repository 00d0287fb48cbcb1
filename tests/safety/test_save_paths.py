"""Paths as users write them. A path string ending in "/" names what it names without it,
as pathlib takes it: a save to "run.h5/" wrote run.h5, but loading, opening, verifying or
converting "run.h5/" failed with "cannot inspect run.h5/: Not a directory"; the same string
now reaches the same checkpoint everywhere. A file where a directory should be is named."""

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


@pytest.mark.parametrize("blocking", [True, False])
def test_a_file_where_a_directory_should_be_is_named(tmp_path, blocking) -> None:
    """Saving below a path that is a file ("run.h5/x.h5") said "directory run.h5 does not
    exist"; it names the file in the way now, and the file is left as it was."""
    ls.save({"a": np.arange(2.0)}, tmp_path / "run.h5")
    before = (tmp_path / "run.h5").read_bytes()
    for inner in ("x.h5", "sub/x.zarr"):
        with pytest.raises(ls.CheckpointError, match=r"run\.h5 is a file, not a directory"):
            ls.save({"a": np.zeros(2)}, tmp_path / "run.h5" / inner, blocking=blocking)
    with pytest.raises(ls.CheckpointError, match="directory .*missing does not exist"):
        ls.save({"a": np.zeros(2)}, tmp_path / "missing" / "x.h5", blocking=blocking)
    assert (tmp_path / "run.h5").read_bytes() == before
