"""Async saves still running when the interpreter exits are finished, not dropped (issue 11.1).

Each case runs a child interpreter whose last statement starts ``ls.save(..., blocking=False)``
and then ends the script: normally, with an uncaught exception, or with ``sys.exit(3)``. The
checkpoint must then exist, load bit for bit, leave no hidden temporary, and the exit status
must be the script's own. Before the fix the writer met thread pools already shut down by
``concurrent.futures``' exit hook: exit status 0, no file, and a hidden Zarr temporary.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import lean_store as ls
import lean_store.writing as writing_mod

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = (".h5", ".zarr")
ENDINGS = {"end": ("", 0), "raise": ("raise ValueError('the script failed')", 1),
           "exit": ("sys.exit(3)", 3)}
TENSORS = 16
SHAPE = (512, 512)  # 1 MiB of float32 each: the CRC of every unit goes to the thread pool


def expected_state() -> dict[str, np.ndarray]:
    return {f"t{i}": (np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE) * (i + 1)
                      - 0.5) for i in range(TENSORS)}


def run_child(body: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        import lean_store as ls
        from test_exit_saves import expected_state
        """
    ) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def hidden(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


@pytest.mark.parametrize("ending", list(ENDINGS))
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_running_save_is_finished_at_exit(tmp_path, suffix, ending):
    statement, status = ENDINGS[ending]
    proc = run_child(f"""
        handle = ls.save(expected_state(), "final{suffix}", blocking=False)
        {statement}
        """, tmp_path)
    assert proc.returncode == status, proc.stderr
    assert "lean_store:" not in proc.stderr  # no failure report
    if ending == "raise":
        assert "ValueError: the script failed" in proc.stderr
    path = tmp_path / f"final{suffix}"
    assert path.exists(), proc.stderr
    back = ls.load_state(path)
    want = expected_state()
    assert list(back) == list(want)
    for name, value in want.items():
        assert back[name].dtype == value.dtype and back[name].tobytes() == value.tobytes(), name
    assert ls.verify(path).ok
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_several_pending_saves_all_finish(tmp_path, suffix):
    proc = run_child(f"""
        for k in range(3):
            ls.save(expected_state(), f"ck{{k}}{suffix}", blocking=False)
        sys.exit(0)
        """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    for k in range(3):
        assert ls.verify(tmp_path / f"ck{k}{suffix}").ok
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_failed_save_nobody_waited_for_is_reported_at_exit(tmp_path, suffix):
    """A save that fails is visible at exit: a message on stderr naming the target."""
    proc = run_child(f"""
        import errno
        from lean_store.stores.hdf5.store import HDF5TensorWriter
        from lean_store.stores.zarr.store import ZarrTensorWriter

        def full(self, *args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        HDF5TensorWriter.write = ZarrTensorWriter.write = full
        HDF5TensorWriter.write_later = ZarrTensorWriter.write_later = full  # written behind
        ls.save(expected_state(), "lost{suffix}", blocking=False)
        """, tmp_path)
    target = tmp_path / f"lost{suffix}"
    lines = [line for line in proc.stderr.splitlines() if line.startswith("lean_store:")]
    assert len(lines) == 1, proc.stderr
    assert f"lost{suffix}" in lines[0] and "never waited for" in lines[0]
    assert "No space left on device" in lines[0] and "lean_store-tmp" not in lines[0]
    assert not target.exists() and hidden(tmp_path) == []


def test_failure_that_was_waited_for_is_not_reported_again(tmp_path):
    proc = run_child("""
        import errno
        from lean_store.stores.hdf5.store import HDF5TensorWriter

        def full(self, *args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        HDF5TensorWriter.write = HDF5TensorWriter.write_later = full
        handle = ls.save(expected_state(), "lost.h5", blocking=False)
        try:
            handle.wait()
        except ls.CheckpointError as exc:
            print("caught", type(exc).__name__)
        """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "caught SaveIOError" in proc.stdout
    assert "lean_store:" not in proc.stderr


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_crc_falls_back_to_inline_when_the_pool_refuses_work(tmp_path, monkeypatch, suffix):
    """A blocking save running while the interpreter shuts down (in a user's own thread) meets
    pools that refuse work; the CRC-32C is then computed in the writer's thread."""

    class RefusingPool:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def submit(self, *args, **kwargs):
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(writing_mod, "ThreadPoolExecutor", RefusingPool)
    path = tmp_path / f"ck{suffix}"
    ls.save(expected_state(), path)
    monkeypatch.undo()
    assert ls.verify(path).ok
    back = ls.load_state(path)
    assert all(back[k].tobytes() == v.tobytes() for k, v in expected_state().items())
