"""HDF5's file locks. An HDF5 checkpoint another process holds open for writing (h5py's
``"r+"`` or ``"a"``, an HDF5 viewer opening files read-write) has HDF5's lock held there.

Reading it is refused with :class:`lean_store.CheckpointBusyError`, which says so and how to
go on, not an ``IntegrityError`` that calls a sound file corrupt; a save over it replaces it
(by a rename: the other process keeps the file it opened); a reader sharing the lock
(``"r"``) blocks nothing. On a file system without locks (NFS mounted ``nolock``: ``flock``
fails with ENOLCK) saves and loads work as anywhere else.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from helpers import preload_library

import lean_store as ls
from lean_store import CheckpointBusyError, IntegrityError
from lean_store.stores.hdf5.files import LOCKING_OPTION, is_lock_conflict

ROOT = Path(__file__).resolve().parents[2]
OLD = {"w": np.arange(10, dtype=np.float32), "b": np.arange(3, dtype=np.int64)}
NEW = {"w": np.ones(4, np.float32)}


@contextmanager
def held(path: Path, mode: str) -> Iterator[None]:
    """Another process with ``path`` open through h5py in ``mode`` until the block ends."""
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, h5py\n"
         f"f = h5py.File({str(path)!r}, {mode!r})\n"
         "print('open', flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "open"
        yield
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "c.h5"
    ls.save(OLD, path)
    return path


def test_reading_a_file_open_for_writing_elsewhere_says_so(checkpoint: Path) -> None:
    with held(checkpoint, "r+"):
        for read in (ls.load_state, ls.open):
            with pytest.raises(CheckpointBusyError) as caught:
                read(checkpoint)
            assert not isinstance(caught.value, IntegrityError)  # the file is sound
            assert caught.value.path == str(checkpoint)
            assert "open for writing in another process" in str(caught.value)
            assert "HDF5_USE_FILE_LOCKING=FALSE" in str(caught.value)
        report = ls.verify(checkpoint)
        assert not report.ok
        assert "open for writing in another process" in str(report)
    back = ls.load_state(checkpoint)  # once closed there: as saved
    assert all(np.array_equal(back[k], v) for k, v in OLD.items())


def test_the_cli_says_it_in_one_line(checkpoint: Path) -> None:
    with held(checkpoint, "a"):
        run = subprocess.run([sys.executable, "-m", "lean_store", "inspect", str(checkpoint)],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode != 0
    out = (run.stdout + run.stderr).strip()
    assert "Traceback" not in out
    assert len(out.splitlines()) == 1
    assert "CheckpointBusyError" in out and "open for writing" in out


def test_a_save_over_it_replaces_it(checkpoint: Path) -> None:
    with held(checkpoint, "r+"):
        ls.save(NEW, checkpoint)  # identified as a checkpoint without the lock, renamed over
        back = ls.load_state(checkpoint)  # the new file: nobody holds it
    assert back.keys() == NEW.keys() and np.array_equal(back["w"], NEW["w"])
    assert ls.verify(checkpoint).ok


def test_a_foreign_hdf5_file_open_elsewhere_is_still_refused(tmp_path: Path) -> None:
    import h5py

    path = tmp_path / "data.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(3)
    with held(path, "r+"):
        with pytest.raises(ls.ForeignPathError, match="without lean_store's root metadata"):
            ls.save(NEW, path)
    with h5py.File(path, "r") as f:
        assert list(f) == ["x"]


def test_readers_sharing_the_lock_block_nothing(checkpoint: Path) -> None:
    with held(checkpoint, "r"):
        back = ls.load_state(checkpoint)
        assert all(np.array_equal(back[k], v) for k, v in OLD.items())
        ls.save(NEW, checkpoint)
    assert np.array_equal(ls.load_state(checkpoint)["w"], NEW["w"])


def test_hdf5s_own_switch_reads_it_anyway(checkpoint: Path) -> None:
    with held(checkpoint, "r+"):
        run = subprocess.run(
            [sys.executable, "-c",
             "import sys, numpy as np, lean_store as ls\n"
             "back = ls.load_state(sys.argv[1])\n"
             "print(back['w'].tolist(), back['b'].tolist())\n", str(checkpoint)],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "HDF5_USE_FILE_LOCKING": "FALSE"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"{OLD['w'].tolist()} {OLD['b'].tolist()}"


def test_only_hdf5s_lock_failure_counts_as_busy() -> None:
    lock = BlockingIOError(11, "Unable to synchronously open file (unable to lock file, "
                               "errno = 11, error message = 'Resource temporarily unavailable')")
    assert is_lock_conflict(lock)
    assert not is_lock_conflict(OSError(2, "Unable to synchronously open file (file signature "
                                           "not found)"))
    assert not is_lock_conflict(FileNotFoundError(2, "unable to lock file"))


NO_LOCKS_SHIM = """
#include <errno.h>
int flock(int fd, int operation) { (void)fd; (void)operation; errno = ENOLCK; return -1; }
"""


def test_a_file_system_without_locks(tmp_path: Path) -> None:
    """Every ``flock`` fails with ENOLCK ("No locks available", NFS without its lock daemon),
    through a preloaded ``flock``: HDF5 then failed every save ("cannot save: No locks
    available") and every load."""
    assert LOCKING_OPTION  # h5py's wheels: HDF5 1.14+
    shim = preload_library(tmp_path, NO_LOCKS_SHIM)
    script = (
        "import sys, fcntl, numpy as np, lean_store as ls\n"
        "try:\n"
        "    fcntl.flock(sys.stdin.fileno(), fcntl.LOCK_SH)\n"
        "except OSError as e:\n"
        "    print('flock', e.errno)\n"
        "path = sys.argv[1]\n"
        "ls.save({'w': np.arange(5, dtype=np.float32)}, path)\n"
        "print(ls.load_state(path)['w'].tolist(), ls.verify(path).ok)\n"
        "ls.save({'w': np.arange(6, dtype=np.float32)}, path)\n"
        "print(ls.load_state(path)['w'].tolist())\n"
    )
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "c.h5")],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "LD_PRELOAD": str(shim)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == [
        f"flock {errno.ENOLCK}",  # the shim is in force
        "[0.0, 1.0, 2.0, 3.0, 4.0] True",
        "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]",
    ]
