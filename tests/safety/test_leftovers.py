"""A save killed mid-write leaves its hidden temporary behind; the next committed save to the
same path removes it, and never one that a running writer, another host or an older version
wrote (lean_store.stores.leftovers)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import wait_for_child

import lean_store as ls
import lean_store.writing as core
from lean_store.stores import commit, leftovers

_STALLED = textwrap.dedent("""
    import sys, time
    import numpy as np
    import lean_store as ls
    import lean_store.writing as core

    path, marker = sys.argv[1], sys.argv[2]
    original = core.crc32c_of

    def stall(bits, crc=0):  # hang in the middle of the save, after data was written
        if not stall.done:
            stall.done = True
            open(marker, "w").close()
            time.sleep(float(sys.argv[3]))
        return original(bits, crc)

    stall.done = False
    core.crc32c_of = stall
    ls.save({f"t{i}": np.full((64, 64), i, np.float32) for i in range(8)}, path)
    print("committed")
""")


def _stalled_save(path: Path, marker: Path, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _STALLED, str(path), str(marker),
                             str(seconds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    wait_for_child(marker.exists, proc)
    return proc


def _temporaries(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.lean_store-tmp-*"))


def _dead_pid() -> int:
    """The PID of a child that exited and was reaped: it names no process (until reused,
    which only keeps files)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def _dead_temporary(path: Path, fill: str) -> Path:
    """A file named as a save to ``path`` of this host whose process died left it."""
    dead = path.with_name(f".{path.name}.lean_store-tmp-{leftovers.owner_tag()}"
                          f"{_dead_pid():08x}{fill * 16}")
    dead.write_bytes(b"x")
    return dead


def _state(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((16, 16), value, np.float32), "b": np.arange(16, dtype=np.int64)}


def test_the_next_save_removes_what_a_killed_save_left(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"ck{suffix}"
    ls.save(_state(1.0), path)
    proc = _stalled_save(path, tmp_path / "marker", 600)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    [left] = _temporaries(path)
    assert left.name[-32:-24] == leftovers.owner_tag()
    assert int(left.name[-24:-16], 16) == proc.pid
    np.testing.assert_array_equal(ls.load_state(path)["w"], _state(1.0)["w"])  # untouched
    ls.save(_state(2.0), path)
    assert _temporaries(path) == []
    np.testing.assert_array_equal(ls.load_state(path)["w"], _state(2.0)["w"])
    ls.verify(path).raise_if_bad()


def test_a_running_writers_temporary_is_kept(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"ck{suffix}"
    proc = _stalled_save(path, tmp_path / "marker", 3)
    try:
        [running] = _temporaries(path)
        ls.save(_state(2.0), path)  # meanwhile, another process saves to the same path
        assert _temporaries(path) == [running]
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "committed" in out, err  # its save was not disturbed
    assert _temporaries(path) == []
    assert ls.load_state(path)["t7"][0, 0] == 7  # the last commit wins


def test_only_dead_temporaries_of_this_host_and_path_are_removed(tmp_path: Path,
                                                                 suffix: str) -> None:
    path = tmp_path / f"ck{suffix}"
    tag = leftovers.owner_tag()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    gone = _dead_pid()
    try:
        def leftover(name: str, directory: bool = False) -> Path:
            p = tmp_path / name
            if directory:
                p.mkdir()
                (p / "zarr.json").write_text("{}")
            else:
                p.write_bytes(b"x" * 100)
            return p

        dead = leftover(f".{path.name}.lean_store-tmp-{tag}{gone:08x}{'0' * 16}")
        dead_tree = leftover(f".{path.name}.lean_store-tmp-{tag}{gone:08x}{'1' * 16}",
                             directory=True)
        kept = [
            leftover(f".{path.name}.lean_store-tmp-{tag}{sleeper.pid:08x}{'2' * 16}"),  # alive
            leftover(f".{path.name}.lean_store-tmp-{'0' * 8}{gone:08x}{'3' * 16}"),  # host
            leftover(f".{path.name}.lean_store-tmp-{'4' * 32}"[:-1]),  # not our naming
            leftover(f".{path.name}.lean_store-tmp-0123456789abcdef0123456789abcdef"),
            leftover(f".{path.name}.lean_store-old-{tag}{gone:08x}{'5' * 16}"),  # aside
            leftover(f".other{suffix}.lean_store-tmp-{tag}{gone:08x}{'6' * 16}"),  # path
        ]
        assert set(commit.clear_dead_temporaries(path)) == {dead, dead_tree}
        assert not dead.exists() and not dead_tree.exists()
        assert all(p.exists() for p in kept)
        leftover(dead.name)
        ls.save(_state(1.0), path)  # a committed save clears them
        assert not dead.exists() and all(p.exists() for p in kept)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_failed_save_removes_nothing(tmp_path: Path, suffix: str, monkeypatch) -> None:
    path = tmp_path / f"ck{suffix}"
    dead = _dead_temporary(path, "7")  # kept until a newer checkpoint is at the path

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(core, "crc32c_of", full)  # fails mid-write, its own copy removed
        with pytest.raises(ls.CheckpointError, match="No space"):
            ls.save(_state(1.0), path)
    assert dead.exists() and _temporaries(path) == [dead]
    ls.save(_state(1.0), path)
    assert _temporaries(path) == []


def test_a_temporary_this_process_abandoned_is_removed(tmp_path: Path) -> None:
    path = tmp_path / "ck.zarr"
    writing = commit.Commit.local(path, directory=True)
    writing.make_directory()
    assert commit.clear_dead_temporaries(path) == []  # still written by this process
    work = writing.work_path
    del writing  # dropped without commit or abort (a DCP save that another rank failed)
    assert work.exists()
    ls.save(_state(1.0), path)
    assert not work.exists() and _temporaries(path) == []


def test_a_removal_that_fails_fails_no_save(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "ck.h5"
    dead = _dead_temporary(path, "8")

    def refuse(p: Path) -> None:
        raise PermissionError(13, "Permission denied", str(p))

    monkeypatch.setattr(commit, "remove_path", refuse)
    ls.save(_state(3.0), path)
    assert dead.exists()
    assert ls.load_state(path)["w"][0, 0] == 3.0


def test_a_running_save_spelled_otherwise_keeps_its_temporary(tmp_path: Path, suffix: str,
                                                               monkeypatch) -> None:
    """This process's save still writing its temporary, the path spelled otherwise (relative,
    or through a linked directory) by the save that commits meanwhile: the temporary is its,
    not removed. (It was: the running save then failed with ENOENT.)"""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.chdir(tmp_path / "real")
    writing = commit.Commit.local(tmp_path / "link" / f"ck{suffix}", directory=suffix == ".zarr")
    if suffix == ".zarr":
        writing.make_directory()
    else:
        writing.work_path.write_bytes(b"")  # as the HDF5 writer creates it
    ls.save(_state(1.0), Path(f"ck{suffix}"))  # commits; clears only dead temporaries
    assert writing.work_path.name in os.listdir(tmp_path / "real")
    writing.abort()


@pytest.mark.parametrize("name_bytes", [206, 207, 255])
def test_a_name_as_long_as_a_file_may_have(tmp_path: Path, suffix: str, monkeypatch,
                                           name_bytes: int) -> None:
    """A checkpoint name of up to 255 bytes saves: its hidden siblings carry a shortened stem
    (first bytes, ``~``, a CRC-32 of the name) where ``.NAME.lean_store-tmp-<32 hex>`` would
    pass 255 bytes (saves of names over 206 bytes failed with ENAMETOOLONG); a later save
    still recognises a dead save's temporary, and a rename-aside overwrite works too."""
    name = "é" * ((name_bytes - len(suffix)) // 2) + "x" * ((name_bytes - len(suffix)) % 2)
    path = tmp_path / f"{name}{suffix}"
    assert len(os.fsencode(path.name)) == name_bytes
    ls.save(_state(1.0), path)
    stem = leftovers.sibling_stem(path)
    assert len(os.fsencode(f".{stem}.lean_store-tmp-")) + 32 <= 255
    assert (stem == path.name) == (name_bytes <= 206)
    dead = path.with_name(f".{stem}.lean_store-tmp-{leftovers.owner_tag()}"
                          f"{_dead_pid():08x}{'a' * 16}")
    dead.write_bytes(b"x")
    ls.save(_state(2.0), path, blocking=False).wait()
    assert not dead.exists()
    monkeypatch.setattr(commit, "_exchange", lambda a, b: False)  # the rename-aside path
    ls.save(_state(3.0), path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    np.testing.assert_array_equal(ls.load_state(path)["w"], _state(3.0)["w"])
