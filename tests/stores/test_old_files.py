"""The file a save replaces is held open across the rename and closed on a background thread
(lean_store.stores.old_files): its blocks are freed there, not in the save; nothing is leaked,
nothing stays visible, a forked child does not keep it, and at most MAX_HELD wait at once."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import lean_store as ls
from lean_store.stores import commit, fs_sync, old_files

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(),
                                reason="needs /proc/self/fd (Linux)")


def _fds_on(inode: int) -> list[int]:
    """This process's descriptors open on the file of ``inode``."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.fstat(int(name)).st_ino == inode:
                out.append(int(name))
        except OSError:
            pass
    return out


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal((64, 64), dtype=np.float32) for i in range(4)}


def test_save_over_a_checkpoint_releases_the_old_file_and_keeps_the_new(tmp_path, monkeypatch):
    path = tmp_path / "ck.h5"
    ls.save(_state(0), path)
    old_inode = path.stat().st_ino
    queued = []
    real = old_files.release_later

    def spy(fd):
        if fd is not None:
            queued.append(os.fstat(fd))
        real(fd)

    monkeypatch.setattr(old_files, "release_later", spy)
    ls.save(_state(1), path)
    old_files.wait_released()
    # the save handed the old file to the background close, no longer named
    assert [(q.st_ino, q.st_nlink) for q in queued] == [(old_inode, 0)]
    assert path.stat().st_ino != old_inode
    assert _fds_on(old_inode) == []  # not held past its release
    got = ls.load_state(path)
    for name, value in _state(1).items():
        assert np.array_equal(got[name], value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.h5"]  # nothing else left


def test_old_file_is_held_until_released(tmp_path):
    """Across the rename the old file keeps its bytes (its blocks are not freed yet), with no
    name left, until the descriptor is closed."""
    path, new = tmp_path / "ck.bin", tmp_path / "new.bin"
    path.write_bytes(b"old" * 1000)
    new.write_bytes(b"new")
    fd = old_files.hold(path)
    assert fd is not None
    os.replace(new, path)
    assert os.fstat(fd).st_nlink == 0  # no name left
    assert os.pread(fd, 6, 0) == b"oldold"  # its blocks still there
    inode = os.fstat(fd).st_ino
    old_files.release_later(fd)
    old_files.wait_released()
    assert _fds_on(inode) == []


def test_a_failed_rename_closes_the_held_file_at_once(tmp_path, monkeypatch):
    path = tmp_path / "ck.h5"
    ls.save(_state(0), path)
    inode = path.stat().st_ino
    real = os.replace

    def refuse(src, dst, *a, **k):
        if Path(dst) == path:
            raise PermissionError(13, "refused", str(dst))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(commit.os, "replace", refuse)
    with pytest.raises(ls.CheckpointError):
        ls.save(_state(1), path)
    monkeypatch.undo()
    assert _fds_on(inode) == []  # released now, not left open
    old_files.wait_released()
    assert path.stat().st_ino == inode  # the old checkpoint is still the one there
    assert np.array_equal(ls.load_state(path)["w0"], _state(0)["w0"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.h5"]


def test_local_file_systems_are_told_apart_from_network_ones(tmp_path, monkeypatch):
    """Only where an open file left without a name stays nameless is the old file held: an
    NFS client (or a FUSE one) would show it as a ``.nfs*`` (``.fuse_hidden*``) file until
    it is closed. The save still replaces the file there, freeing it in the rename."""
    if fs_sync._STATFS is None:  # not Linux x86_64/aarch64: nothing is held anywhere
        assert not fs_sync.open_files_stay_nameless(tmp_path)
        return
    assert fs_sync.open_files_stay_nameless(tmp_path)  # ext4, tmpfs, xfs, btrfs, overlayfs
    if Path("/dev/shm").is_dir():
        assert fs_sync.open_files_stay_nameless(Path("/dev/shm"))
    path = tmp_path / "ck.h5"
    ls.save(_state(0), path)
    inode = path.stat().st_ino
    for magic in (0x6969, 0x65735546, 0xFF534D42):  # NFS, FUSE, CIFS
        monkeypatch.setattr(fs_sync, "_file_system_type", lambda p, m=magic: m)
        assert not fs_sync.open_files_stay_nameless(tmp_path)
        assert old_files.hold(path) is None
    ls.save(_state(1), path)
    assert _fds_on(inode) == []  # not held: freed by the rename itself
    assert np.array_equal(ls.load_state(path)["w1"], _state(1)["w1"])


def test_only_regular_files_are_held_and_links_are_not_followed(tmp_path):
    real = tmp_path / "real.bin"
    real.write_bytes(b"x")
    link = tmp_path / "link.bin"
    link.symlink_to(real)
    assert old_files.hold(link) is None
    assert old_files.hold(tmp_path) is None  # a directory
    assert old_files.hold(tmp_path / "missing") is None
    os.mkfifo(tmp_path / "fifo")
    assert old_files.hold(tmp_path / "fifo") is None  # not opened for long, never blocks


def test_at_most_max_held_wait_to_be_released(tmp_path, monkeypatch):
    """With the background close stalled, the (MAX_HELD + 1)-th release waits for the
    oldest: saves faster than the freeing cannot pile up old files."""
    gate = threading.Event()
    real_close = old_files._close
    started = []

    def slow_close(fd: int) -> None:
        started.append(fd)
        gate.wait(30)
        real_close(fd)

    monkeypatch.setattr(old_files, "_close", slow_close)
    fds = []
    for i in range(old_files.MAX_HELD + 1):
        p = tmp_path / f"f{i}"
        p.write_bytes(b"x")
        fds.append(old_files.hold(p))
    for fd in fds[:-1]:
        old_files.release_later(fd)
    done = threading.Event()

    def last() -> None:
        old_files.release_later(fds[-1])
        done.set()

    t = threading.Thread(target=last)
    t.start()
    assert not done.wait(0.5)  # waits for the oldest close
    gate.set()
    t.join(30)
    assert done.is_set()
    old_files.wait_released()
    assert sorted(started) == sorted(fds)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_save_frees_the_old_files_still_held_before_it_writes(tmp_path, monkeypatch):
    """A save starts only once the file an earlier save replaced is closed: on a nearly full
    disk it never needs more room than when the rename freed the old file at once."""
    gate = threading.Event()
    real_close = old_files._close

    def slow_close(fd: int) -> None:
        gate.wait(30)
        real_close(fd)

    path, other = tmp_path / "ck.h5", tmp_path / "other.h5"
    ls.save(_state(0), path)
    monkeypatch.setattr(old_files, "_close", slow_close)
    ls.save(_state(1), path)  # returns at once: the old file's close waits on the gate
    done = threading.Event()
    errors: list[BaseException] = []

    def next_save() -> None:
        try:
            ls.save(_state(2), other)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        done.set()

    t = threading.Thread(target=next_save)
    t.start()
    assert not done.wait(0.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.h5"]  # nothing written yet
    gate.set()
    t.join(60)
    assert done.is_set() and errors == []
    assert np.array_equal(ls.load_state(other)["w0"], _state(2)["w0"])


def test_a_failed_close_of_an_old_file_fails_no_save(tmp_path, monkeypatch):
    """The old file's close is no part of any save: an error from it (EIO from a failing
    disk) neither fails the save that queued it nor a later one that waits for it."""
    real_close = old_files._close
    closed = []

    def failing_close(fd: int) -> None:
        real_close(fd)
        closed.append(fd)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(old_files, "_close", failing_close)
    path = tmp_path / "ck.h5"
    for i in range(old_files.MAX_HELD + 3):  # later saves wait for the failed closes
        ls.save(_state(i), path)
    old_files.wait_released()
    assert len(closed) == old_files.MAX_HELD + 2
    assert np.array_equal(ls.load_state(path)["w2"], _state(old_files.MAX_HELD + 2)["w2"])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_keep_a_held_file(tmp_path, monkeypatch):
    """A child forked while an old file waits for its release closes its own copy of the
    descriptor (else the child would keep the old checkpoint's space while it lives)."""
    gate = threading.Event()
    real_close = old_files._close

    def slow_close(fd: int) -> None:
        gate.wait(30)
        real_close(fd)

    monkeypatch.setattr(old_files, "_close", slow_close)
    p = tmp_path / "old.bin"
    p.write_bytes(b"x" * 4096)
    fd = old_files.hold(p)
    inode = os.fstat(fd).st_ino
    other = os.open(tmp_path / "other.bin", os.O_CREAT | os.O_RDWR)  # not held: left alone
    old_files.release_later(fd)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's checks come back as its exit status
        try:
            ok = _fds_on(inode) == [] and os.fstat(other) is not None
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    gate.set()
    old_files.wait_released()
    os.close(other)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _fds_on(inode) == []


def test_many_saves_over_one_path_leave_no_descriptor(tmp_path):
    path = tmp_path / "latest.h5"
    before = len(os.listdir("/proc/self/fd"))
    for i in range(12):
        ls.save(_state(i), path)
    old_files.wait_released()
    assert len(os.listdir("/proc/self/fd")) == before
    assert np.array_equal(ls.load_state(path)["w3"], _state(11)["w3"])


def test_exit_waits_for_queued_releases(tmp_path):
    """A process that saves over a checkpoint and exits at once still closes the old file:
    the releases queued are done before the interpreter exits (no error, no hang)."""
    import subprocess

    path = tmp_path / "ck.h5"
    ls.save(_state(0), path)
    code = (
        "import numpy as np, lean_store as ls, sys\n"
        f"ls.save({{'w': np.arange(1 << 20, dtype=np.float32)}}, {str(path)!r})\n"
        "print('saved')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "saved" and done.stderr == ""
    assert np.array_equal(ls.load_state(path)["w"], np.arange(1 << 20, dtype=np.float32))
