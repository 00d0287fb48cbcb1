"""A save the operating system refuses (read-only file system, full disk) names the target and
leaves no temporary (issue 11.10).

Real conditions first: a tiny tmpfs filled up, and a tmpfs remounted read-only (the tests run as
root, so permissions would not stop a write; mounting needs privileges, and those tests skip
only when mounting is impossible). The same failures are then injected at each stage of a save
(creating the temporary, writing a chunk, the final rename) by monkeypatching, which always
runs. Before the fix the error was a bare OSError naming the hidden temporary, and a failure
while creating the temporary (a completely full disk) left it behind.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np
import pytest

import lean_store as ls
from lean_store.errors import SaveIOError
from lean_store.stores.hdf5.store import HDF5TensorWriter
from lean_store.stores.zarr.store import ZarrTensorWriter

SUFFIXES = (".h5", ".zarr")
WRITERS = {".h5": HDF5TensorWriter, ".zarr": ZarrTensorWriter}


def small(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((16, 16)).astype(np.float32)}


def big() -> dict[str, np.ndarray]:
    return {f"t{i}": np.full((256, 256), i, np.float32) for i in range(8)}  # 2 MiB


def hidden(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


def check_error(exc: BaseException, target: Path, code: int) -> None:
    assert isinstance(exc, SaveIOError) and isinstance(exc, ls.CheckpointError)
    assert isinstance(exc, OSError) and exc.errno == code
    assert exc.filename == str(target)
    assert str(target) in str(exc) and "lean_store-tmp" not in str(exc)
    assert os.strerror(code) in str(exc)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


# ------------------------------------------------------------------- real file systems


@contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    where.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def remount_read_only(where: Path) -> None:
    done = subprocess.run(["mount", "-o", "remount,ro", str(where)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot remount read-only: {done.stderr.strip()}")


def fill(where: Path) -> None:
    """Fill the file system completely (tmpfs allocates whole pages: no page is left)."""
    with open(where / "filler", "wb", buffering=0) as f:
        block = b"\xff" * 4096
        try:
            while True:
                f.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    assert shutil.disk_usage(where).free == 0


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_full_disk_mid_save(tmp_path, suffix, blocking):
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        target = mnt / f"ck{suffix}"
        ls.save(small(), target)
        with pytest.raises(SaveIOError) as info:
            result = ls.save(big(), target, blocking=blocking)
            if not blocking:
                result.wait()
        check_error(info.value, target, errno.ENOSPC)
        assert hidden(mnt) == []
        assert same(ls.load_state(target), small())  # the previous checkpoint is intact


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_completely_full_disk(tmp_path, suffix):
    with tmpfs(tmp_path / "mnt", "256k") as mnt:
        target = mnt / f"ck{suffix}"
        ls.save(small(), target)
        fill(mnt)
        with pytest.raises(SaveIOError) as info:
            ls.save(small(1), target)
        check_error(info.value, target, errno.ENOSPC)
        assert hidden(mnt) == []
        assert same(ls.load_state(target), small())
        fresh = mnt / f"fresh{suffix}"
        with pytest.raises(SaveIOError) as info:
            ls.save(small(1), fresh)
        check_error(info.value, fresh, errno.ENOSPC)
        assert hidden(mnt) == [] and not fresh.exists()


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_read_only_directory(tmp_path, suffix):
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        target = mnt / f"ck{suffix}"
        ls.save(small(), target)
        remount_read_only(mnt)
        with pytest.raises(SaveIOError) as info:
            ls.save(small(1), target)
        check_error(info.value, target, errno.EROFS)
        fresh = mnt / f"fresh{suffix}"
        with pytest.raises(SaveIOError) as info:
            ls.save(small(1), fresh)
        check_error(info.value, fresh, errno.EROFS)
        assert hidden(mnt) == [] and sorted(os.listdir(mnt)) == [target.name]
        assert same(ls.load_state(target), small())


# ------------------------------------------------------------- injected, always run


def enospc(path: object = "") -> OSError:
    return OSError(errno.ENOSPC, "Can't write data (file write failed, errno = 28, error "
                   f"message = 'No space left on device', filename = '{path}')", str(path))


def fail_creating(monkeypatch, suffix: str, code: int, create: bool) -> None:
    """The temporary's creation fails, after creating it (``create``: as a full disk does,
    where the directory entry fits but its first bytes do not) or before."""
    if suffix == ".h5":
        real_file = h5py.File

        def h5file(name, mode="r", *args, **kwargs):
            if mode == "r":  # reading what is at the target is fine
                return real_file(name, mode, *args, **kwargs)
            if create:
                Path(name).touch()
            raise OSError(code, os.strerror(code), str(name))

        monkeypatch.setattr(h5py, "File", h5file)
    else:  # the temporary directory's mkdir (a Zarr save opens no zarr group for it)
        real_mkdir = Path.mkdir

        def mkdir(self, *args, **kwargs):
            if ".lean_store-tmp-" not in self.name:
                return real_mkdir(self, *args, **kwargs)
            if create:
                real_mkdir(self)
            raise OSError(code, os.strerror(code), str(self))

        monkeypatch.setattr(Path, "mkdir", mkdir)


@pytest.mark.parametrize("create", [True, False])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_creating_the_temporary_fails(tmp_path, monkeypatch, suffix, code, create):
    target = tmp_path / f"ck{suffix}"
    ls.save(small(), target)
    fail_creating(monkeypatch, suffix, code, create)
    with pytest.raises(SaveIOError) as info:
        ls.save(small(1), target)
    monkeypatch.undo()
    check_error(info.value, target, code)
    assert hidden(tmp_path) == []
    assert same(ls.load_state(target), small())


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_writing_a_chunk_fails(tmp_path, monkeypatch, suffix, blocking):
    target = tmp_path / f"ck{suffix}"
    ls.save(small(), target)

    def write(self, region, bits, crc=None):
        raise enospc(tmp_path / f".{target.name}.lean_store-tmp-0123")

    monkeypatch.setattr(WRITERS[suffix], "write", write)
    # small HDF5 chunks of host tensors are written behind in batches, not by write
    monkeypatch.setattr(WRITERS[suffix], "small_later", False, raising=False)
    with pytest.raises(SaveIOError) as info:
        result = ls.save(big(), target, blocking=blocking)
        if not blocking:
            result.wait()
    monkeypatch.undo()
    check_error(info.value, target, errno.ENOSPC)
    assert hidden(tmp_path) == []
    assert same(ls.load_state(target), small())


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_the_final_rename_fails(tmp_path, monkeypatch, suffix):
    target = tmp_path / f"ck{suffix}"
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if str(dst) == str(target):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(src), None, str(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(SaveIOError) as info:
        ls.save(small(), target)
    monkeypatch.undo()
    check_error(info.value, target, errno.EROFS)
    assert hidden(tmp_path) == [] and not target.exists()


def test_sharded_location_names_the_target(tmp_path, monkeypatch):
    from lean_store.stores.commit import Commit

    target = tmp_path / "ck.zarr"

    def mkdir(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(SaveIOError) as info:
        Commit.at(target, directory=True).make_directory()
    monkeypatch.undo()
    check_error(info.value, target, errno.EROFS)
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
@pytest.mark.parametrize("blocking", [True, False])
def test_a_relative_path_in_a_removed_working_directory(tmp_path, monkeypatch, suffix,
                                                        blocking):
    """The working directory was deleted under the process (a job's scratch directory
    cleaned up): a save of a relative path is a SaveIOError, not the raw FileNotFoundError
    of ``os.getcwd``."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(SaveIOError, match="No such file"):
        handle = ls.save({"w": np.arange(6.0)}, f"ck{suffix}", blocking=blocking)
        if not blocking:
            handle.wait()
    with pytest.raises(ls.CheckpointError):
        ls.Checkpointer("run")
