"""A save replaces only a lean_store checkpoint (or an empty directory) (issue 11.2).

Whatever else is at the target (a directory tree, a regular file, a foreign HDF5 file, a
symbolic link, a FIFO) is refused with ForeignPathError naming the path and what is there, and
is left exactly as it was. Before the fix ``save`` deleted directory trees and overwrote files.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest

import lean_store as ls
from lean_store.errors import ForeignPathError
from lean_store.stores.commit import Commit, replace_atomically
from lean_store.stores.hdf5.store import HDF5TensorWriter
from lean_store.stores.target import check_replaceable, is_checkpoint
from lean_store.stores.zarr.store import ZarrTensorWriter

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = (".h5", ".zarr")
WRITERS = {".h5": HDF5TensorWriter, ".zarr": ZarrTensorWriter}


def state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((32, 16)).astype(np.float32), "n": np.arange(7)}


def snapshot(path: Path) -> dict[str, object]:
    """Every entry under ``path`` (not following links): its kind and bytes or link target."""
    out: dict[str, object] = {}
    if path.is_symlink():
        return {".": ("link", os.readlink(path))}
    if path.is_file():
        return {".": ("file", path.read_bytes())}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            p = Path(root) / name
            rel = str(p.relative_to(path))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", None)
            elif p.is_file():
                out[rel] = ("file", p.read_bytes())
            else:
                out[rel] = ("other", None)
    return out


def hidden(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


def make_tree(path: Path) -> None:
    path.mkdir()
    (path / "notes.txt").write_text("my notes")
    (path / "data").mkdir()
    (path / "data" / "x.bin").write_bytes(b"\x00\x01\x02")


def make_foreign_hdf5(path: Path) -> None:
    with h5py.File(path, "w") as f:
        f["measurements"] = np.arange(10.0)
        f.attrs["lean_store"] = "not really"  # a look-alike attribute is not enough


def make_truncated_checkpoint(path: Path) -> None:
    """A damaged checkpoint cannot be recognised as one: refused, to be removed by hand."""
    whole = path.with_name("whole.h5")
    ls.save(state(), whole)
    path.write_bytes(whole.read_bytes()[:200])
    whole.unlink()


OCCUPANTS = {
    "tree": (make_tree, r"a directory with 2 entries \('data', 'notes.txt'\)"),
    "text file": (lambda p: p.write_text("important"),
                  "a regular file of 9 bytes that is not HDF5"),
    "empty file": (lambda p: p.write_bytes(b""), "an empty regular file"),
    "foreign hdf5": (make_foreign_hdf5, "an HDF5 file of .* bytes without lean_store's root"),
    "fifo": (lambda p: os.mkfifo(p), r"a FIFO \(named pipe\)"),
    "truncated hdf5": (make_truncated_checkpoint, "an HDF5 file of 200 bytes that cannot be open"),
}


@pytest.mark.parametrize("occupant", list(OCCUPANTS))
@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("blocking", [True, False])
def test_foreign_occupant_is_refused_and_untouched(tmp_path, suffix, occupant, blocking):
    make, words = OCCUPANTS[occupant]
    path = tmp_path / f"target{suffix}"
    make(path)
    before = snapshot(path) if occupant != "fifo" else None
    with pytest.raises(ForeignPathError, match=words) as info:
        ls.save(state(), path, blocking=blocking)
    assert str(path) in str(info.value) and info.value.path == str(path)
    assert "Remove it first" in str(info.value)
    if occupant == "fifo":
        assert path.is_fifo()
    else:
        assert snapshot(path) == before
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_symlink_is_refused_even_to_a_checkpoint(tmp_path, suffix):
    real = tmp_path / f"real{suffix}"
    ls.save(state(1), real)
    link = tmp_path / f"link{suffix}"
    link.symlink_to(real.name)
    before = snapshot(real)
    with pytest.raises(ForeignPathError, match="a symbolic link"):
        ls.save(state(2), link)
    assert link.is_symlink() and os.readlink(link) == real.name and snapshot(real) == before


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_checkpoint_is_replaced(tmp_path, suffix):
    path = tmp_path / f"ck{suffix}"
    ls.save(state(1), path)
    ls.save(state(2), path)
    back = ls.load_state(path)
    assert back["w"].tobytes() == state(2)["w"].tobytes()
    assert hidden(tmp_path) == []


def test_an_empty_directory_is_replaced_by_a_zarr_store_not_by_a_file(tmp_path):
    path = tmp_path / "ck.zarr"
    path.mkdir()
    ls.save(state(), path)
    assert ls.verify(path).ok
    other = tmp_path / "ck.h5"
    other.mkdir()
    with pytest.raises(ls.CheckpointError, match="it is an empty directory"):
        ls.save(state(), other)
    assert other.is_dir() and not any(other.iterdir())


def test_a_checkpoint_of_the_other_kind_is_refused(tmp_path):
    """An HDF5 checkpoint (a file) where a Zarr store (a directory) is asked for."""
    path = tmp_path / "ck.zarr"
    ls.save(state(1), path, backend="hdf5")
    before = snapshot(path)
    with pytest.raises(ls.CheckpointError, match="it is a checkpoint file"):
        ls.save(state(2), path, backend="zarr")
    assert snapshot(path) == before


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_something_appearing_during_the_save_is_not_replaced(tmp_path, monkeypatch, suffix):
    """The check is made again just before the commit: a tree created meanwhile survives."""
    path = tmp_path / f"ck{suffix}"
    writer_cls = WRITERS[suffix]
    original = writer_cls.write
    made = threading.Event()

    def write(self, region, bits, crc=None):
        if not made.is_set():
            made.set()
            make_tree(path) if suffix == ".zarr" else path.write_text("appeared")
        return original(self, region, bits, crc)

    monkeypatch.setattr(writer_cls, "write", write)
    # small HDF5 chunks of host tensors are written behind in batches, not by write
    monkeypatch.setattr(writer_cls, "small_later", False, raising=False)
    before = None
    with pytest.raises(ForeignPathError):
        try:
            ls.save(state(), path)
        finally:
            before = snapshot(path)
    monkeypatch.undo()
    assert made.is_set() and snapshot(path) == before
    assert hidden(tmp_path) == []


def test_recognition(tmp_path):
    ck_h5, ck_zarr = tmp_path / "a.h5", tmp_path / "b.zarr"
    ls.save(state(), ck_h5)
    ls.save(state(), ck_zarr)
    assert is_checkpoint(ck_h5) and is_checkpoint(ck_zarr)
    make_foreign_hdf5(tmp_path / "f.h5")
    assert not is_checkpoint(tmp_path / "f.h5")
    plain = tmp_path / "plain.zarr"  # a Zarr group that is not lean_store's
    import zarr

    zarr.open_group(str(plain), mode="w", zarr_format=3).attrs["x"] = 1
    assert not is_checkpoint(plain)
    with pytest.raises(ForeignPathError, match="a directory with 1 entry"):
        check_replaceable(plain)
    check_replaceable(tmp_path / "absent")  # nothing there: fine


def test_replace_atomically_refuses_a_foreign_target(tmp_path):
    tmp = tmp_path / ".new"
    tmp.write_bytes(b"new")
    target = tmp_path / "target"
    target.write_bytes(b"old")
    with pytest.raises(ForeignPathError):
        replace_atomically(tmp, target)
    assert target.read_bytes() == b"old"


def test_sharded_location_refuses_a_foreign_directory(tmp_path):
    target = tmp_path / "ck.zarr"
    make_tree(target)
    before = snapshot(target)
    with pytest.raises(ForeignPathError, match="a directory with 2 entries"):
        Commit.at(target, directory=True)
    assert snapshot(target) == before and hidden(tmp_path) == []
    # something foreign appearing while the ranks write is refused at the commit
    fresh = tmp_path / "fresh.zarr"
    location = Commit.at(fresh, directory=True)
    location.make_directory()
    (Path(location.work) / "zarr.json").write_text("{}")
    fresh.write_text("appeared")
    with pytest.raises(ForeignPathError):
        location.commit()
    location.abort()
    assert fresh.read_text() == "appeared" and hidden(tmp_path) == []


def test_convert_refuses_a_foreign_output(tmp_path):
    from lean_store.interop.convert import convert

    src = tmp_path / "src.h5"
    ls.save(state(), src)
    dst = tmp_path / "dst.zarr"
    make_tree(dst)
    before = snapshot(dst)
    with pytest.raises(ForeignPathError):
        convert(src, dst)
    assert snapshot(dst) == before


def _checkpointer_run():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model


def test_checkpointer_never_deletes_a_foreign_step_path(tmp_path):
    model = _checkpointer_run()
    run = tmp_path / "run"
    run.mkdir()
    foreign = run / "step_0000000001.h5"  # named like a step, but someone else's file
    foreign.write_text("not a checkpoint")
    ck = ls.Checkpointer(run, keep_last=1)
    with pytest.warns(UserWarning, match="not pruning step 1"):
        ck.save(2, model=model)
    assert foreign.read_text() == "not a checkpoint"
    assert is_checkpoint(run / "step_0000000002.h5")
    # overwriting step 1 in the other backend would delete the foreign file: refused first
    zck = ls.Checkpointer(run, backend="zarr")
    with pytest.raises(ForeignPathError):
        zck.save(1, model=model, overwrite=True)
    assert foreign.read_text() == "not a checkpoint"
    assert not (run / "step_0000000001.zarr").exists()


SHARDED_CHILD = """
import os, sys, torch, torch.distributed as dist
import lean_store as ls
from lean_store.distributed import LocalShard
from lean_store.errors import ForeignPathError
out = sys.argv[1]
dist.init_process_group("gloo", init_method="file://" + os.path.join(out, "rendezvous"),
                        rank=0, world_size=1)
for suffix in (".h5", ".zarr"):
    target = os.path.join(out, "foreign" + suffix)
    os.mkdir(target)
    open(os.path.join(target, "keep.txt"), "w").write("mine")
    try:
        ls.save({"w": LocalShard(torch.ones(4, 3), (4, 3), (0, 0))}, target)
    except ForeignPathError as exc:
        print("refused", suffix, "a directory with 1 entry" in str(exc))
    ck = os.path.join(out, "ck" + suffix)
    ls.save({"w": LocalShard(torch.ones(4, 3), (4, 3), (0, 0))}, ck)
    ls.save({"w": LocalShard(torch.full((4, 3), 2.0), (4, 3), (0, 0))}, ck)  # a checkpoint
    print("replaced", suffix, float(ls.load_state(ck)["w"].sum()))
dist.destroy_process_group()
import os, sys; sys.stdout.flush(); os._exit(0)  # why: tests/gloo_world.py leave_world
"""


def test_sharded_save_refuses_foreign_and_replaces_checkpoints(tmp_path):
    pytest.importorskip("torch")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SHARDED_CHILD), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for suffix in (".h5", ".zarr"):
        assert f"refused {suffix} True" in proc.stdout, proc.stdout + proc.stderr
        assert f"replaced {suffix} 24.0" in proc.stdout, proc.stdout + proc.stderr
        assert (tmp_path / f"foreign{suffix}" / "keep.txt").read_text() == "mine"
    assert hidden(tmp_path) == []
