"""Saves to one path in one process end with the state of the save called last
(lean_store/stores/commit_order.py): a background save still writing when a later save
commits discards what it wrote instead of publishing older state over newer."""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lean_store as ls
from lean_store.stores import commit, commit_order

SUFFIXES = (".h5", ".zarr")


def _state(value: float, n: int = 3) -> dict[str, np.ndarray]:
    return {f"t{i}": np.full(64, value, np.float32) for i in range(n)}


def _holds(path: Path) -> float:
    values = {float(v[0]) for v in ls.load_state(path).values()}
    assert len(values) == 1  # one save's state, whole
    return values.pop()


def _temporaries(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}"))


class _HeldCommit:
    """Holds the first commit that reaches ``fsync_tree`` until :meth:`go`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reached, self.release = threading.Event(), threading.Event()
        self._first = True
        real = commit.fsync_tree

        def held(*args: Any, **kwargs: Any) -> None:
            if self._first and threading.current_thread() is not threading.main_thread():
                self._first = False
                self.reached.set()
                assert self.release.wait(60)
            real(*args, **kwargs)

        monkeypatch.setattr(commit, "fsync_tree", held)

    def go(self) -> None:
        self.release.set()


def _first_save_held(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[_HeldCommit, Any]:
    """A background save of state 1.0 to ``path``, written and held just before its commit:
    (the hold, its handle)."""
    held = _HeldCommit(monkeypatch)
    first = ls.save_async(_state(1.0), path)
    assert held.reached.wait(60)  # written, about to commit
    return held, first


@pytest.fixture(params=SUFFIXES)
def held_first(request: pytest.FixtureRequest, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> tuple[Path, _HeldCommit, Any]:
    """(path, hold, handle): a checkpoint of state 0.0 at ``path``, then a background save of
    state 1.0 to it, written and held just before its commit."""
    path = tmp_path / f"c{request.param}"
    ls.save(_state(0.0), path)
    return (path, *_first_save_held(path, monkeypatch))


@pytest.mark.parametrize("later", ["blocking", "background"])
def test_a_background_save_finishing_last_does_not_undo_a_later_save(
        held_first: tuple[Path, _HeldCommit, Any], later: str) -> None:
    path, held, first = held_first
    if later == "blocking":
        ls.save(_state(2.0), path)  # called later, commits first
    else:
        ls.save_async(_state(2.0), path).wait()
    assert _holds(path) == 2.0
    held.go()
    first.wait()  # no error: it ended, superseded
    assert _holds(path) == 2.0
    assert _temporaries(path) == []
    assert commit_order.pending(path) == 0
    ls.save(_state(3.0), path)  # the order goes on
    assert _holds(path) == 3.0


def test_a_later_save_that_fails_leaves_the_earlier_one_to_publish(
        held_first: tuple[Path, _HeldCommit, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    path, held, first = held_first
    real = commit._publish

    def refused(*args: Any) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as patch:
        patch.setattr(commit, "_publish", refused)
        with pytest.raises(ls.SaveIOError):
            ls.save(_state(2.0), path)
    assert commit._publish is real
    held.go()
    first.wait()
    assert _holds(path) == 1.0  # the newest save that succeeded
    assert _temporaries(path) == [] and commit_order.pending(path) == 0


def test_saves_to_other_paths_are_not_held(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    held, first = _first_save_held(tmp_path / "a.h5", monkeypatch)
    ls.save(_state(2.0), tmp_path / "b.h5")  # commits while a.h5's save is held
    assert _holds(tmp_path / "b.h5") == 2.0 and not (tmp_path / "a.h5").exists()
    held.go()
    first.wait()
    assert _holds(tmp_path / "a.h5") == 1.0


def test_one_path_however_spelled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.chdir(tmp_path)
    held, first = _first_save_held(tmp_path / "link" / "c.h5", monkeypatch)
    ls.save(_state(2.0), Path("real") / ".." / "real" / "c.h5")
    held.go()
    first.wait()
    assert _holds(tmp_path / "real" / "c.h5") == 2.0


def test_a_background_save_that_fails_early_releases_its_turn(tmp_path: Path) -> None:
    path = tmp_path / "c.h5"
    handle = ls.save_async({"x": np.ones(3)}, path, checksum="nonesuch")  # refused in its thread
    with pytest.raises(ls.CheckpointError, match="nonesuch"):
        handle.wait()
    assert commit_order.pending(path) == 0
    ls.save(_state(4.0), path)
    assert _holds(path) == 4.0


def test_many_background_saves_end_with_the_last_called(tmp_path: Path) -> None:
    path = tmp_path / "c.zarr"
    rng = np.random.default_rng(0)
    handles = [ls.save_async(_state(float(k), int(rng.integers(1, 40))), path)
               for k in range(12)]
    for handle in handles:
        handle.wait()
    assert _holds(path) == 11.0
    assert _temporaries(path) == [] and commit_order.pending(path) == 0
