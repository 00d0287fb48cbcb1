"""HDF5 chunks of 2 MiB or more read whole are read in two halves on two threads, each half's
CRC-32C computed by its thread and combined: the chunk is still checked whole before it is
returned, a damaged byte in either half is caught, and a failing read on the worker is an
IntegrityError after the worker has stopped writing into the output."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import lean_store as ls
from lean_store import read_ahead
from lean_store.integrity import crc_workers
from lean_store.stores.hdf5 import store as hdf5_store

RNG = np.random.default_rng(9)
STATE = {
    "one": RNG.standard_normal(1 << 20, dtype=np.float32),  # one 4 MiB chunk
    "odd": RNG.standard_normal(777_777, dtype=np.float32),  # one chunk, not a page multiple
    "small": RNG.standard_normal(1000, dtype=np.float32),  # read in one piece
}


class _Reads:
    """Which threads read how many bytes through ``_pread_into``. With ``wait_for_worker``
    the calling thread's k-th first half waits until a worker has started its k-th second
    half (else, by design, a caller done first reads the second half itself: the counts
    would depend on timing)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_on_worker: bool = False,
                 wait_for_worker: bool = False) -> None:
        self.by_thread: dict[str, int] = {}
        self._lock = threading.Condition()
        started = [0, 0]  # second halves started on a worker, first halves on the caller
        real = hdf5_store.HDF5Reader._pread_into

        def pread_into(reader: Any, node: str, coords: Any, flat: np.ndarray,
                       offset: int) -> None:
            name = threading.current_thread().name
            with self._lock:
                self.by_thread[name] = self.by_thread.get(name, 0) + flat.nbytes
                if wait_for_worker and flat.nbytes >= hdf5_store.SPLIT_READ_BYTES // 4:
                    if name == "MainThread":
                        started[1] += 1
                        assert self._lock.wait_for(lambda: started[0] >= started[1], 30)
                    else:
                        started[0] += 1
                        self._lock.notify_all()
            if fail_on_worker and name != "MainThread":
                raise ls.IntegrityError(f"tensor {node!r}: chunk {coords} unreadable (injected)")
            real(reader, node, coords, flat, offset)

        monkeypatch.setattr(hdf5_store.HDF5Reader, "_pread_into", pread_into)


def _save(tmp_path: Path) -> Path:
    path = tmp_path / "ck.h5"
    ls.save(STATE, path)
    return path


def test_halves_read_on_two_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _save(tmp_path)
    # the tensors on this thread alone, not also the read-ahead worker's (read_ahead.py)
    monkeypatch.setattr(read_ahead, "READ_AHEAD_MIN_BYTES", 1 << 62)
    reads = _Reads(monkeypatch, wait_for_worker=True)
    loaded = ls.load_state(path)
    for name, value in STATE.items():
        assert loaded[name].tobytes() == value.tobytes(), name
    workers = {k: v for k, v in reads.by_thread.items() if k.startswith("lean_store-crc")}
    assert workers and sum(workers.values()) == (4 << 20) // 2 + (777_777 * 4 - (
        777_777 * 4 // 2 // 4096 * 4096))
    assert reads.by_thread["MainThread"] == (4 << 20) // 2 + 777_777 * 4 // 2 // 4096 * 4096 \
        + 4000
    with ls.open(path) as ck:  # a whole-chunk read of a region, into a scratch chunk
        np.testing.assert_array_equal(ck["one"][10:20], STATE["one"][10:20])


@pytest.mark.parametrize("where", [100, (2 << 20) + 100, (4 << 20) - 1])
def test_damage_in_either_half_is_caught(tmp_path: Path, where: int) -> None:
    path = _save(tmp_path)
    with h5py.File(path, "r") as f:
        offset = f["one"].id.get_chunk_info(0).byte_offset
    raw = bytearray(path.read_bytes())
    raw[offset + where] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(ls.IntegrityError, match="'one'"):
        ls.load_state(path)
    with ls.open(path) as ck:
        assert ck.read_bits("odd").tobytes() == STATE["odd"].tobytes()


def test_failed_read_on_the_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _save(tmp_path)
    monkeypatch.setattr(read_ahead, "READ_AHEAD_MIN_BYTES", 1 << 62)  # as above
    _Reads(monkeypatch, fail_on_worker=True, wait_for_worker=True)
    with pytest.raises(ls.IntegrityError, match="injected"):
        ls.load_state(path)


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path)
    with h5py.File(path, "r") as f:
        info = f["one"].id.get_chunk_info(0)
    raw = path.read_bytes()
    path.write_bytes(raw[: info.byte_offset + (3 << 20)])
    with pytest.raises(ls.CheckpointError):
        ls.load_state(path)


def test_busy_workers_are_not_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With both workers busy (a save's units, say), the caller reads the second half itself
    rather than waiting for them."""
    path = _save(tmp_path)
    monkeypatch.setattr(read_ahead, "READ_AHEAD_MIN_BYTES", 1 << 62)  # as above
    release = threading.Event()
    started = threading.Barrier(3)

    def busy() -> None:
        started.wait()
        release.wait(60)

    blockers = [crc_workers().submit(busy) for _ in range(2)]
    started.wait()
    try:
        reads = _Reads(monkeypatch)
        loaded = ls.load_state(path)
        assert set(reads.by_thread) == {"MainThread"}
        for name, value in STATE.items():
            assert loaded[name].tobytes() == value.tobytes(), name
    finally:
        release.set()
        for blocker in blockers:
            blocker.result()
