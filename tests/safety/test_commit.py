"""The one commit (lean_store.stores.commit): every writer publishes through it.

For each writer (HDF5, Zarr, a URL, sharded saves, safetensors, ``.pt``, TorchLean) the tests
check that it goes through :class:`Commit`, that a failure in the middle of a write leaves the
previous file intact and no temporary behind, and that the parent directory is fsynced after the
rename. The interop writers replace a file of their own kind only.
"""

from __future__ import annotations

import ast
import errno
import json
import os
import stat
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch_optional import needs_torch

import lean_store as ls
import lean_store.writing
from lean_store.cli import main
from lean_store.errors import CheckpointError, ForeignPathError, SaveIOError
from lean_store.interop.convert import open_input, write_output
from lean_store.interop.safetensors_io import write_safetensors
from lean_store.interop.torchlean import (
    SF32_FILE,
    atomic_write,
    decode_adam,
    read_adam,
    read_sf32,
    read_state_json,
    write_adam,
    write_sf32,
    write_state_json,
)
from lean_store.interop.torchlean_bridge import state_json_of
from lean_store.sources import tensor_source
from lean_store.stores.commit import Commit, LocalCommit, URLCommit

ROOT = Path(__file__).resolve().parents[2]
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def state(value: float) -> dict[str, np.ndarray]:
    return {"a": np.full((4, 3), value, np.float32), "b": np.arange(6, dtype=np.int64) + value}


def hidden(folder: Path) -> list[str]:
    """Temporaries (and anything else hidden) left in ``folder``."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture
def commits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every Commit.commit call: (kind, target)."""
    calls: list[tuple[str, str]] = []
    for cls, kind in ((LocalCommit, "local"), (URLCommit, "url")):
        real = cls.commit

        def spy(self: Commit, real: Any = real, kind: str = kind) -> None:
            calls.append((kind, str(self.target)))
            real(self)

        monkeypatch.setattr(cls, "commit", spy)
    return calls


@pytest.fixture
def synced_dirs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths of the directories fsynced (os.fsync on a directory descriptor)."""
    seen: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


@contextmanager
def failing_after_first_unit() -> Iterator[None]:
    """The save pipeline fails after its first write unit went into the temporary."""
    real = lean_store.writing.crc32c_of
    calls = [0]

    def crc(bits: Any) -> int:
        calls[0] += 1
        if calls[0] > 1:
            raise OSError(errno.ENOSPC, "disk full (injected)")
        return real(bits)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lean_store.writing, "crc32c_of", crc)
        yield


# ------------------------------------------------------------------ single-process stores


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_store_saves_go_through_the_commit_and_sync_the_parent(tmp_path, suffix, commits,
                                                               synced_dirs):
    path = tmp_path / f"ck{suffix}"
    ls.save(state(1), path)
    ls.save(state(2), path)  # an overwrite: rename (file) or exchange (directory)
    assert commits == [("local", str(path))] * 2
    assert synced_dirs.count(str(tmp_path)) >= 2
    assert ls.load_state(path)["a"][0, 0] == 2 and hidden(tmp_path) == []


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_store_failure_mid_save_keeps_the_old_checkpoint(tmp_path, suffix, commits):
    path = tmp_path / f"ck{suffix}"
    ls.save(state(1), path)
    with failing_after_first_unit(), pytest.raises(SaveIOError, match="No space"):
        ls.save(state(2), path)
    assert commits == [("local", str(path))]  # the first save only
    assert ls.load_state(path)["a"][0, 0] == 1 and hidden(tmp_path) == []


def test_url_save_goes_through_the_url_commit(tmp_path, commits):
    url = f"file://{tmp_path}/u.zarr"
    ls.save(state(3), url)
    assert commits == [("url", url)]
    assert ls.load_state(url)["b"].tolist() == (np.arange(6) + 3).tolist()
    with pytest.raises(CheckpointError, match="never overwrites"):
        ls.save(state(4), url)
    assert ls.load_state(url)["a"][0, 0] == 3


def test_url_failure_mid_save_removes_the_prefix(commits):
    import fsspec

    url = "memory://lean-store-test-commit/fail.zarr"
    with failing_after_first_unit(), pytest.raises(SaveIOError):
        ls.save(state(1), url)
    assert commits == []
    fs = fsspec.filesystem("memory")
    assert not fs.exists("/lean-store-test-commit/fail.zarr")
    ls.save(state(2), url)  # the prefix is free again
    assert commits == [("url", url)]
    assert ls.load_state(url)["a"][0, 0] == 2
    fs.rm("/lean-store-test-commit", recursive=True)


# ------------------------------------------------------------------------ the Commit API


def test_local_commit_of_a_file(tmp_path, synced_dirs):
    target = tmp_path / "out.h5"
    with Commit.local(target, directory=False) as commit:
        assert Path(commit.work).parent == tmp_path and Path(commit.work).name.startswith(".")
        Path(commit.work).write_bytes(HDF5_SIGNATURE)  # not a checkpoint: but target is absent
        commit.commit()
    assert target.read_bytes() == HDF5_SIGNATURE and hidden(tmp_path) == []
    assert str(tmp_path) in synced_dirs
    with pytest.raises(CheckpointError, match="already committed"):
        commit.commit()


def test_leaving_the_block_without_committing_aborts(tmp_path):
    target = tmp_path / "out.zarr"
    with Commit.local(target, directory=True) as commit:
        commit.make_directory()
        (Path(commit.work) / "zarr.json").write_text("{}")
    assert not target.exists() and hidden(tmp_path) == []
    with pytest.raises(CheckpointError, match="already aborted"):
        commit.commit()
    with pytest.raises(RuntimeError), Commit.local(target, directory=False) as commit:
        Path(commit.work).write_bytes(b"half")
        raise RuntimeError("writer failed")
    assert not target.exists() and hidden(tmp_path) == []


def test_local_commit_refuses_a_foreign_target_before_and_at_the_rename(tmp_path):
    foreign = tmp_path / "notes.h5"
    foreign.write_text("mine")
    with pytest.raises(ForeignPathError):
        Commit.local(foreign, directory=False)
    target = tmp_path / "new.h5"
    commit = Commit.local(target, directory=False)
    Path(commit.work).write_bytes(b"data")
    target.write_text("appeared while writing")
    with pytest.raises(ForeignPathError):
        commit.commit()
    commit.abort()
    assert target.read_text() == "appeared while writing" and hidden(tmp_path) == []


def test_local_commit_needs_the_parent_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Commit.local(tmp_path / "missing" / "x.h5", directory=False)


def test_os_refusal_at_the_rename_names_the_target(tmp_path, monkeypatch):
    target = tmp_path / "out.safetensors"
    commit = Commit.local(target, directory=False)
    Path(commit.work).write_bytes(b"x")

    def refuse(a: Any, b: Any) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(a))

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(SaveIOError) as info:
        commit.commit()
    monkeypatch.undo()
    commit.abort()
    assert info.value.filename == str(target) and info.value.errno == errno.EROFS
    assert hidden(tmp_path) == [] and not target.exists()


def test_url_commit_refuses_an_existing_prefix_and_abort_removes_what_was_written(tmp_path):
    (tmp_path / "taken.zarr").mkdir()
    with pytest.raises(CheckpointError, match="never overwrites"):
        Commit.url(f"file://{tmp_path}/taken.zarr")
    url = f"file://{tmp_path}/new.zarr"
    commit = Commit.at(url, directory=True)
    assert isinstance(commit, URLCommit) and commit.work == url
    (tmp_path / "new.zarr").mkdir()
    (tmp_path / "new.zarr" / "zarr.json").write_text("{}")
    commit.abort()
    assert not (tmp_path / "new.zarr").exists()


# ------------------------------------------------------------------------ interop writers


def safetensors_file(path: Path, value: float) -> None:
    write_safetensors(tensor_source({"w": np.full(3, value, np.float32)}), path)


def torch_file(path: Path, value: float) -> None:
    with open_input(_h5(path.parent, value)) as inp:
        write_output(inp, path, "torch")


def sf32_file(path: Path, value: float) -> None:
    write_sf32(path, [np.full(3, value, np.float32)])


def json_file(path: Path, value: float) -> None:
    with open_input(_h5(path.parent, value)) as inp:
        write_state_json(path, state_json_of(inp.layout, inp.read_words))


def adam_file(path: Path, value: float) -> None:
    write_adam(path, decode_adam(_adam_bytes(value)))


def _h5(folder: Path, value: float) -> Path:
    source = folder / f"src-{value}.h5"
    if not source.exists():
        ls.save({"w": np.full(3, value, np.float32)}, source)
    return source


def _adam_bytes(value: float) -> bytes:
    def u64(*v: int) -> bytes:
        return struct.pack(f"<{len(v)}Q", *v)

    hyper = [struct.unpack("<Q", struct.pack("<d", x))[0] for x in (0.9, 0.999, 1e-8, 0.0)]
    moments = np.full(2, value, "<f4").tobytes()
    return (b"TLADAMF" + u64(2, 0, *hyper) + u64(1) + u64(1, 2, 2, 1) + u64(1)
            + u64(0, 1, 2) + moments + moments)


def read_back(kind: str, path: Path) -> float:
    if kind == "safetensors":
        from safetensors.numpy import load_file

        return float(load_file(path)["w"][0])
    if kind == "torch":
        import torch

        return float(torch.load(path, weights_only=True)["w"][0])
    if kind == "sf32":
        return float(read_sf32(path)[0][0])
    if kind == "json":
        return float(np.asarray(read_state_json(path).tensors[0]).view(np.float32)[0])
    return float(read_adam(path).entries[0].m[0])


WRITERS = {
    "safetensors": (safetensors_file, "w.safetensors"),
    "torch": (torch_file, "w.pt"),
    "sf32": (sf32_file, "w.tlsf32"),
    "json": (json_file, "w.json"),
    "adam": (adam_file, "opt.bin"),
}
INTEROP = [pytest.param(k, marks=needs_torch) if k == "torch" else k for k in WRITERS]


@pytest.mark.parametrize("kind", INTEROP)
def test_interop_writer_commits_replaces_its_kind_and_syncs_the_parent(tmp_path, kind, commits,
                                                                       synced_dirs):
    write, name = WRITERS[kind]
    path = tmp_path / name
    write(path, 1.0)
    write(path, 2.0)  # a file of the same kind: replaced
    assert [c for c in commits if c[1] == str(path)] == [("local", str(path))] * 2
    assert synced_dirs.count(str(tmp_path)) >= 2  # the rename made durable, both times
    assert read_back(kind, path) == 2.0
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("kind", INTEROP)
@pytest.mark.parametrize("occupant", ["directory", "text", "empty", "link", "other-kind"])
def test_interop_writer_refuses_what_is_not_its_kind(tmp_path, kind, occupant):
    write, name = WRITERS[kind]
    path = tmp_path / name
    if occupant == "directory":
        path.mkdir()
        (path / "keep.txt").write_text("mine")
    elif occupant == "text":
        path.write_text("my notes, not a tensor file\n" * 10)
    elif occupant == "empty":
        path.write_bytes(b"")
    elif occupant == "link":
        (tmp_path / "real").write_text("mine")
        path.symlink_to(tmp_path / "real")
    else:  # a file some other writer produced
        other = "adam" if kind == "sf32" else "sf32"
        WRITERS[other][0](tmp_path / "other", 1.0)
        os.replace(tmp_path / "other", path)
    before = path.read_bytes() if path.is_file() else None
    with pytest.raises(ForeignPathError, match="refusing to replace"):
        write(path, 2.0)
    if occupant == "directory":
        assert (path / "keep.txt").read_text() == "mine"
    elif occupant == "link":
        assert path.is_symlink() and (tmp_path / "real").read_text() == "mine"
    else:
        assert path.read_bytes() == before
    assert hidden(tmp_path) == []


def test_a_checkpoint_is_not_replaced_by_an_interop_file(tmp_path):
    ck = tmp_path / "ck.safetensors"
    ls.save(state(1), tmp_path / "ck.h5")
    os.replace(tmp_path / "ck.h5", ck)  # a lean_store checkpoint under a safetensors name
    with pytest.raises(ForeignPathError, match="not a safetensors file"):
        safetensors_file(ck, 2.0)
    assert ls.load_state(ck)["a"][0, 0] == 1


def test_torchlean_failure_mid_write_keeps_the_old_file(tmp_path, commits):
    path = tmp_path / "w.tlsf32"
    sf32_file(path, 1.0)
    old = path.read_bytes()

    def chunks():
        yield b"TLSF32B"
        raise OSError(errno.ENOSPC, "disk full (injected)")

    with pytest.raises(SaveIOError):
        atomic_write(path, chunks(), SF32_FILE)
    assert path.read_bytes() == old and hidden(tmp_path) == []
    assert len(commits) == 1


def test_safetensors_failure_mid_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "w.safetensors"
    safetensors_file(path, 1.0)
    old = path.read_bytes()

    class Failing:
        def advance(self, n: int) -> None:
            raise OSError(errno.EIO, "I/O error (injected)")

    source = tensor_source({"w": np.full(3, 2.0, np.float32), "x": np.zeros(2, np.int8)})
    with pytest.raises(SaveIOError) as info:
        write_safetensors(source, path, progress=Failing())
    assert info.value.filename == str(path) and info.value.errno == errno.EIO
    assert path.read_bytes() == old and hidden(tmp_path) == []


@needs_torch
def test_torch_failure_mid_write_keeps_the_old_file(tmp_path, monkeypatch):
    import torch

    path = tmp_path / "w.pt"
    torch_file(path, 1.0)
    old = path.read_bytes()

    def half_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"PK\x03\x04 half")
        raise OSError(errno.ENOSPC, "disk full (injected)")

    monkeypatch.setattr(torch, "save", half_save)
    with pytest.raises(SaveIOError, match="No space left"):
        torch_file(path, 2.0)
    monkeypatch.undo()
    assert path.read_bytes() == old and hidden(tmp_path) == []


def test_cli_force_replaces_a_file_of_the_same_kind_only(tmp_path, capsys):
    src = _h5(tmp_path, 5.0)
    dst = tmp_path / "out.safetensors"
    assert main(["convert", str(src), str(dst)]) == 0
    assert main(["convert", "--force", str(src), str(dst)]) == 0  # same kind: replaced
    (tmp_path / "notes.safetensors").write_text("my notes")
    code = main(["convert", "--force", str(src), str(tmp_path / "notes.safetensors")])
    err = capsys.readouterr().err
    assert code != 0 and "refusing to replace" in err and "Traceback" not in err
    assert (tmp_path / "notes.safetensors").read_text() == "my notes"
    out = tmp_path / "state.json"
    assert main(["export", "--json", "-o", str(out), str(src)]) == 0
    assert json.loads(out.read_text())["state"][0]["shape"] == [3]
    out.write_text("[1, 2, 3]")  # JSON, but not TorchLean state
    assert main(["export", "--json", "--force", "-o", str(out), str(src)]) != 0
    assert out.read_text() == "[1, 2, 3]" and hidden(tmp_path) == []


# --------------------------------------------------------------------------- sharded saves


SHARDED_CHILD = """
import errno, json, os, stat, sys
import torch, torch.distributed as dist
import lean_store as ls
from lean_store.distributed import LocalShard
from lean_store.stores import sharded_layout
from lean_store.stores.commit import LocalCommit, URLCommit

out = sys.argv[1]
dist.init_process_group("gloo", init_method="file://" + os.path.join(out, "rendezvous"),
                        rank=0, world_size=1)
calls, synced = [], []
for cls, kind in ((LocalCommit, "local"), (URLCommit, "url")):
    def spy(self, real=cls.commit, kind=kind):
        calls.append([kind, str(self.target)])
        real(self)
    cls.commit = spy
real_fsync = os.fsync
def fsync(fd):
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
    real_fsync(fd)
os.fsync = fsync

def shard(value):
    return {"w": LocalShard(torch.full((4, 3), float(value)), (4, 3), (0, 0))}

result = {}
folder = os.path.join(out, "run")
os.mkdir(folder)
for name in ("ck.h5", "ck.zarr", "file://" + os.path.join(folder, "u.zarr")):
    path = name if "://" in name else os.path.join(folder, name)
    ls.save(shard(1), path)
    if "://" not in name:
        ls.save(shard(2), path)  # a replacement
    real = sharded_layout.write_box
    def failing(*args, **kwargs):
        raise OSError(errno.ENOSPC, "disk full (injected)")
    sharded_layout.write_box = failing
    target = path if "://" not in name else path + ".failed"
    try:
        ls.save(shard(3), target)
        failed = "no error"
    except Exception as exc:
        failed = type(exc).__name__
    sharded_layout.write_box = real
    result[name] = {"value": float(ls.load_state(path)["w"].sum()), "failed": failed,
                    "failed_exists": os.path.exists(target.split("://")[-1])
                    if "://" in name else None}
result["calls"] = calls
result["synced"] = synced
result["hidden"] = sorted(n for n in os.listdir(folder) if n.startswith("."))
print(json.dumps(result))
dist.destroy_process_group()
import os, sys; sys.stdout.flush(); os._exit(0)  # why: tests/gloo_world.py leave_world
"""


@needs_torch
def test_sharded_saves_go_through_the_commit(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SHARDED_CHILD), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    folder = str(tmp_path / "run")
    url = "file://" + os.path.join(folder, "u.zarr")
    published = [c for c in result["calls"] if os.path.dirname(c[1]) == folder or c[0] == "url"]
    assert published == [
        ["local", os.path.join(folder, "ck.h5")], ["local", os.path.join(folder, "ck.h5")],
        ["local", os.path.join(folder, "ck.zarr")], ["local", os.path.join(folder, "ck.zarr")],
        ["url", url],
    ]
    # the rest: each rank's HDF5 shard file, itself committed into the hidden work directory
    inner = [c for c in result["calls"] if c not in published]
    assert inner and all(os.path.basename(os.path.dirname(c[1])).startswith(".ck.h5.")
                         and os.path.basename(c[1]).startswith("shard-") for c in inner)
    for name in ("ck.h5", "ck.zarr"):
        assert result[name]["value"] == 24.0  # the second save; the failed third left it
        assert result[name]["failed"] != "no error"
    assert result[url]["value"] == 12.0 and result[url]["failed_exists"] is False
    assert result["synced"].count(folder) >= 4  # the parent, after each local rename
    assert result["hidden"] == []


# ----------------------------------------------------------------------------- structure


def test_no_rename_outside_the_commit_module():
    """Every rename that publishes a file is in stores/commit.py; the few others are listed
    here with why they are not a commit."""
    allowed = {
        "lean_store/stores/commit.py",
        "lean_store/stores/zarr/incremental.py",  # a hard link swapped in inside the temporary
        "lean_store/interop/torch_io.py",  # torch.save's scratch file moved onto the temporary
        "lean_store/training/checkpointer.py",  # an old checkpoint renamed aside to delete it
    }
    found = set()
    for path in (ROOT / "lean_store").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("replace", "rename", "renames")
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "os"):
                found.add(path.relative_to(ROOT).as_posix())
    assert found <= allowed, found - allowed
