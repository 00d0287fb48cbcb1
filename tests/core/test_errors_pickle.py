"""lean_store's errors survive pickling: an error raised in a DataLoader worker, a process pool
or a spawned process reaches the parent as it was raised. ``SaveIOError`` could not be
unpickled at all (``TypeError: 'str' object cannot be interpreted as an integer``: a
``multiprocessing`` pool whose worker's save failed hung for ever), and
``CheckpointReplacedError`` and ``CheckpointBusyError`` came back with their message wrapped
in a second one."""

from __future__ import annotations

import errno
import multiprocessing
import pickle
from pathlib import Path

import numpy as np
import pytest

import lean_store as ls
from lean_store.errors import CheckpointBusyError, CheckpointReplacedError, SaveIOError
from lean_store.layout import Difference

ERRORS = [
    SaveIOError.wrapping("run/ck.h5", OSError(errno.ENOSPC, "No space left on device")),
    SaveIOError("rank 1: cannot save"),  # rebuilt from another rank's message
    CheckpointReplacedError("run/ck.zarr", "after the handle was pickled"),
    CheckpointBusyError("run/ck.h5"),
    ls.ForeignPathError.at("run", "a directory with 3 entries"),
    ls.LayoutError("1 difference", [Difference("shape", "w", (2,), (3,))]),
    ls.TensorNotFoundError("no tensor 'x' in ck.h5"),
    ls.IntegrityError("tensor 'w': crc32c mismatch"),
    ls.UnsupportedValueError("state entry 's' is a sparse tensor"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_an_error_comes_back_as_it_was_raised(error: Exception) -> None:
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert again.__dict__ == error.__dict__
    if isinstance(error, OSError):
        assert (again.errno, again.strerror, again.filename) == (
            error.errno, error.strerror, error.filename)


def _save_past_the_file_size_limit(directory: str) -> None:
    """A worker whose writes are capped at 64 KiB (RLIMIT_FSIZE, SIGXFSZ ignored: writes past
    it fail with EFBIG, as a full disk fails with ENOSPC)."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
    ls.save({"w": np.ones(1 << 18)}, Path(directory) / "ck.h5")


def test_a_worker_process_reports_the_save_error_itself(tmp_path) -> None:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        pending = pool.apply_async(_save_past_the_file_size_limit, (str(tmp_path),))
        with pytest.raises(ls.SaveIOError) as info:  # before: the pool hung, unpickling it
            pending.get(timeout=120)
    assert info.value.errno == errno.EFBIG and "ck.h5" in str(info.value)
    assert not (tmp_path / "ck.h5").exists()
