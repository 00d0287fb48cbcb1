"""An incremental step compares a large piece (2 MiB or more) with the base's file in two
halves at once, the second on a helper thread: a difference anywhere (first half, second
half, the last byte) is still a difference, equal bytes still link, and the file is never
read after the comparison returns."""

from __future__ import annotations

import os
import threading

import google_crc32c
import numpy as np
import pytest

from lean_store.stores.zarr import incremental
from lean_store.stores.zarr.incremental import IncrementalStats, UnitLinker

SIZE = 5 << 20  # 5 windows: halves of 2 and 3 MiB


def _word(data: bytes) -> bytes:
    return int(google_crc32c.value(data)).to_bytes(4, "little")


@pytest.fixture
def base(tmp_path):
    data = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)
    root, new = tmp_path / "base", tmp_path / "new"
    root.mkdir()
    new.mkdir()
    (root / "c0").write_bytes(data.tobytes() + _word(data.tobytes()))
    return UnitLinker(root, new, IncrementalStats()), data, root, new


def _readers(monkeypatch) -> list[tuple[str, int, int]]:
    """(thread name, descriptor, offset) of every pread of the comparison."""
    calls: list[tuple[str, int, int]] = []
    real = os.preadv

    def recording(fd, buffers, offset):
        calls.append((threading.current_thread().name, fd, offset))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", recording)
    return calls


def test_equal_large_piece_is_linked_and_compared_on_two_threads(base, monkeypatch):
    unit, data, root, new = base
    calls = _readers(monkeypatch)
    unit.link_or_write(new / "c0", "c0", [data, _word(data.tobytes())])
    monkeypatch.undo()
    assert os.path.samefile(new / "c0", root / "c0")
    assert unit.stats.linked_files == 1
    names = {name for name, _fd, _at in calls}
    assert len(names) == 2 and any(n.startswith("lean_store-compare") for n in names)
    assert sorted(at for _n, _fd, at in calls) == [i << 20 for i in range(5)]  # every window


@pytest.mark.parametrize("where", [0, (2 << 20) - 1, 2 << 20, SIZE - 1])
def test_one_changed_byte_in_either_half_is_written(base, where):
    """The CRC word is the base's (a collision stand-in): only the bytes tell."""
    unit, data, root, new = base
    changed = data.copy()
    changed[where] ^= 0x40
    unit.link_or_write(new / "c0", "c0", [changed, _word(data.tobytes())])
    assert not os.path.samefile(new / "c0", root / "c0")
    assert (new / "c0").read_bytes() == changed.tobytes() + _word(data.tobytes())
    assert unit.stats.written_files == 1 and unit.stats.linked_files == 0


def test_a_difference_stops_the_other_half_and_it_is_waited_for(base, monkeypatch):
    """The first half differs at once: the helper stops at its next window, and no read of
    the file happens after the comparison returned (its descriptor is closed then)."""
    unit, data, root, new = base
    changed = data.copy()
    changed[10] ^= 1
    calls = _readers(monkeypatch)
    unit.link_or_write(new / "c0", "c0", [changed, _word(data.tobytes())])
    after = len(calls)
    monkeypatch.undo()
    assert unit.stats.written_files == 1
    assert after < 5  # not every window was read
    helper = incremental._helper_pool()
    helper.submit(lambda: None).result()  # anything the helper had queued has run
    assert len(calls) == after


def test_the_helper_pool_is_renewed_in_a_forked_child():
    first = incremental._helper_pool()
    pid = os.fork()
    if pid == 0:  # the child: the parent's helper thread does not exist here
        code = 0
        try:
            pool = incremental._helper_pool()
            code = 0 if pool is not first and pool.submit(lambda: 7).result(timeout=10) == 7 else 1
        except BaseException:
            code = 2
        os._exit(code)
    _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert incremental._helper_pool() is first
