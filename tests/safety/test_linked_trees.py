"""Checkpoint directories whose files are symlinks: what the Hugging Face Hub cache (each file
of a snapshot links to a blob), git-annex and DVC's symlink cache make of a directory. lean_store
reads only the regular files of a checkpoint directory (docs/SECURITY.md): such a tree is
refused, naming the link, where it points and the copy that reads (``cp -rL``), and that copy
loads bit for bit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from torch_optional import require_torch

import lean_store as ls
from lean_store.errors import UnsafeFileError

ROOT = Path(__file__).resolve().parents[2]
STATE = {"w": np.arange(24, dtype=np.float32).reshape(4, 6), "b": np.ones(5, np.float64)}


def _as_blobs(tree: Path, blobs: Path, *, only: str | None = None) -> None:
    """Move the regular files of ``tree`` (or only those whose path holds ``only``) into
    ``blobs``, each left behind as an absolute symlink to its blob, as a Hub snapshot is."""
    blobs.mkdir(exist_ok=True)
    for i, path in enumerate(sorted(p for p in tree.rglob("*") if p.is_file())):
        if only is not None and only not in str(path.relative_to(tree)):
            continue
        blob = blobs / f"{i:04d}"
        shutil.move(path, blob)
        path.symlink_to(blob)


def _refused_with_the_way(path: Path) -> str:
    with pytest.raises(UnsafeFileError) as info:
        ls.load_state(path)
    message = str(info.value)
    assert "a symlink inside the checkpoint" in message
    assert str(path.parent / "blobs") in message  # where the link points
    assert "cp -rL" in message and "local_dir=" in message  # the way to a copy that reads
    return message


def _copy_reads(path: Path, tmp_path: Path) -> None:
    copy = tmp_path / ("copy" + path.suffix)
    shutil.copytree(path, copy, symlinks=False)  # what cp -rL does: the links' targets copied
    got = ls.load_state(copy)
    assert all(got[k].tobytes() == v.tobytes() for k, v in STATE.items())
    assert ls.verify(copy).ok


@pytest.mark.parametrize("only", [None, "w/"])
def test_zarr_tree_of_links_is_refused_with_the_copy_that_reads(tmp_path, only) -> None:
    path = tmp_path / "model.zarr"
    ls.save(STATE, path)
    _as_blobs(path, tmp_path / "blobs", only=only)
    _refused_with_the_way(path)
    assert not ls.verify(path).ok
    _copy_reads(path, tmp_path)


def test_zarr_array_folder_linked_is_refused_the_same_way(tmp_path) -> None:
    path = tmp_path / "model.zarr"
    ls.save(STATE, path)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shutil.move(path / "w", blobs / "w")
    (path / "w").symlink_to(blobs / "w", target_is_directory=True)
    _refused_with_the_way(path)
    _copy_reads(path, tmp_path)


SHARDED_SAVE = """
import sys
import numpy as np
import torch.distributed as dist
import lean_store as ls
from lean_store.distributed.local_state import LocalShard

dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1])
ls.save({name: LocalShard(value, value.shape, (0,) * value.ndim)
         for name, value in {"w": np.arange(24, dtype=np.float32).reshape(4, 6),
                             "b": np.ones(5, np.float64)}.items()}, sys.argv[2])
dist.destroy_process_group()
import os; sys.stdout.flush(); os._exit(0)  # why: tests/gloo_world.py leave_world
"""


@pytest.mark.parametrize("only", [None, "shard-"])
def test_sharded_hdf5_tree_of_links_is_refused_not_called_missing(tmp_path, only) -> None:
    """The master file or a shard file as a link was reported as missing ("no master file",
    "shard file ... is missing"), which it is not."""
    require_torch()  # sharded saves need torch.distributed
    path = tmp_path / "model.h5"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", SHARDED_SAVE, str(tmp_path / "pg"), str(path)],
                   env=env, check=True, timeout=600)
    assert path.is_dir()
    _as_blobs(path, tmp_path / "blobs", only=only)
    message = _refused_with_the_way(path)
    assert "missing" not in message
    assert ("shard file" if only else "master file") in message
    _copy_reads(path, tmp_path)
