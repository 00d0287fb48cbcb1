"""A process forked while a background save runs (torch DataLoader workers, ``multiprocessing``
pools) saves, loads and exits like any other; the parent's save is finished by the parent.

Before: every such child hung at its exit, spinning in the exit hook that waits for running
saves (the parent's, whose thread the child does not have); an HDF5 save in the child hung on
the lock the parent's HDF5 save held; and a child forked during a process's first background
save hung at its first import of the store module the save's thread was importing."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tool_runner import tool_env

import lean_store as ls
import lean_store.async_save as async_save
from lean_store.stores.hdf5 import store as hdf5_store

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX's")
STATE = {f"t{i}": np.arange(4096, dtype=np.float32) * (i + 1) for i in range(8)}
CHILD_SECONDS = 60  # a child that has not exited by then hangs


def _child(folder: str, results: Any) -> None:
    """Save and load on both backends, then try to wait for the parent's save."""
    try:
        for suffix in (".h5", ".zarr"):
            path = os.path.join(folder, f"child{suffix}")
            ls.save({"c": np.arange(5.0)}, path)
            ok = ls.load_state(path)["c"].tolist() == list(range(5))
            results.put((suffix, ok))
        try:
            HANDLE.wait(timeout=1)
            results.put(("wait", "returned"))
        except ls.CheckpointError as exc:
            results.put(("wait", str(exc)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put(("error", repr(exc)))


HANDLE: Any = None


def _blocked_save(monkeypatch: pytest.MonkeyPatch, path: Path, where: str
                  ) -> tuple[Any, threading.Event, threading.Event]:
    """A background save held at ``where`` ("start": before it writes anything; "hdf5": inside
    an HDF5 save, holding its one-save-at-a-time lock) until ``release`` is set."""
    reached, release = threading.Event(), threading.Event()
    parent = os.getpid()  # the child inherits the patch: only the parent's save is held
    if where == "start":
        real = async_save.write_source

        def held(*args: Any, **kwargs: Any) -> Any:
            reached.set()
            release.wait(60)
            return real(*args, **kwargs)

        monkeypatch.setattr(async_save, "write_source", held)
    else:
        real_add = hdf5_store.HDF5Writer.add_tensor

        def held_add(self: Any, *args: Any, **kwargs: Any) -> Any:
            if os.getpid() == parent:
                reached.set()
                release.wait(60)
            return real_add(self, *args, **kwargs)

        monkeypatch.setattr(hdf5_store.HDF5Writer, "add_tensor", held_add)
    handle = ls.save_async(STATE, path)
    assert reached.wait(30)
    return handle, reached, release


@pytest.mark.parametrize("where", ["start", "hdf5"])
def test_a_child_forked_during_a_background_save_saves_loads_and_exits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    global HANDLE
    target = tmp_path / ("parent.h5" if where == "hdf5" else "parent.zarr")
    handle, _reached, release = _blocked_save(monkeypatch, target, where)
    HANDLE = handle
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_child, args=(str(tmp_path), results))
    try:
        child.start()
        child.join(CHILD_SECONDS)
        alive = child.is_alive()
        if alive:
            child.kill()
            child.join()
    finally:
        release.set()
        HANDLE = None
    assert not alive, "the forked child hung"
    assert child.exitcode == 0
    got = dict(results.get(timeout=5) for _ in range(3))
    assert got[".h5"] is True and got[".zarr"] is True
    assert f"runs in process {os.getpid()}" in got["wait"]
    handle.wait()  # the parent's save, finished by the parent
    back = ls.load_state(target)
    assert all(np.array_equal(back[k], v) for k, v in STATE.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["child.h5", "child.zarr", target.name])


def _run_script(code: str, path: Path) -> subprocess.CompletedProcess[str]:
    """``python -c code path`` with this checkout's lean_store, output captured."""
    return subprocess.run([sys.executable, "-c", code, str(path)], env=tool_env(),
                          capture_output=True, text=True, timeout=180)


_FIRST_SAVE = """
import sys, threading
import numpy as np
import lean_store as ls
import lean_store.async_save as async_save
release = threading.Event()
real = async_save.write_source
def held(*args, **kwargs):
    release.wait(60)
    return real(*args, **kwargs)
async_save.write_source = held
store = "lean_store.stores.{backend}.store"
assert store not in sys.modules
handle = ls.save_async({{"w": np.ones(3)}}, sys.argv[1])
# imported by the caller: a child forked now must not meet the save thread's import lock
print(store in sys.modules)
release.set()
handle.wait()
"""


@pytest.mark.parametrize(("backend", "suffix"), [("hdf5", ".h5"), ("zarr", ".zarr")])
def test_a_first_background_save_imports_its_store_on_the_callers_thread(
        tmp_path: Path, backend: str, suffix: str) -> None:
    done = _run_script(textwrap.dedent(_FIRST_SAVE.format(backend=backend)),
                       tmp_path / f"first{suffix}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"


_CHILD_EXITS_NORMALLY = """
import os, sys, threading
import numpy as np
import lean_store as ls
from lean_store.stores.hdf5 import store
state = {f"t{i}": np.arange(20000, dtype=np.float32) * (i + 1) for i in range(60)}
reached, release = threading.Event(), threading.Event()
real, count, parent = store.HDF5Writer.add_tensor, [0], os.getpid()
def held(self, *args, **kwargs):
    count[0] += 1
    if os.getpid() == parent and count[0] == 30:  # half the tensors are in the file
        reached.set()
        release.wait(60)
    return real(self, *args, **kwargs)
store.HDF5Writer.add_tensor = held
handle = ls.save_async(state, sys.argv[1])
assert reached.wait(60)
go_r, go_w = os.pipe()
pid = os.fork()
if pid == 0:  # waits until the parent's save is committed, then exits normally: libhdf5's
    os.read(go_r, 1)  # exit handler closes the files it holds open (the parent's, as forked)
    sys.exit(0)
release.set()
handle.wait()
os.write(go_w, b"x")
os.waitpid(pid, 0)
ls.verify(sys.argv[1]).raise_if_bad()
back = ls.load_state(sys.argv[1])
print(all(np.array_equal(back[k], v) for k, v in state.items()))
"""


def test_a_child_that_exits_normally_leaves_the_parents_hdf5_save_intact(tmp_path: Path
                                                                         ) -> None:
    done = _run_script(_CHILD_EXITS_NORMALLY, tmp_path / "parent.h5")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"
