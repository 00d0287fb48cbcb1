"""``ls.load_state`` reads its tensors on two threads (``lean_store/read_ahead.py``): exact bits
whichever thread reads a tensor, a damaged chunk read by the read-ahead worker still raises,
and an error on either thread returns nothing and leaves no read running."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import ALL_FORMATS, BACKENDS, SUFFIX, assert_same_state, sample_bits, value_of

import lean_store as ls
from lean_store import read_ahead
from lean_store.checkpoint import Checkpoint
from lean_store.errors import IntegrityError

WAIT = 60  # seconds a thread waits for the other before the test fails (never hit when sound)


def _state() -> dict:
    """Every format, and enough float32 weights (several tensors of several chunks) to pass
    read_ahead's size threshold."""
    rng = np.random.default_rng(7)
    state = {f"f{i}": value_of(sample_bits(fmt, rng), fmt) for i, fmt in enumerate(ALL_FORMATS)}
    for i in range(6):
        state[f"w{i}"] = (rng.standard_normal((256, 512)) * 0.02).astype(np.float32)
    return state


def _on_both_threads(monkeypatch, before_read=None, method: str = "read_bits"
                     ) -> dict[str, int]:
    """Make the first two tensors of a load go one to each thread (each waits for the other to
    start) through ``Checkpoint.<method>``; returns {name: thread id} as the reads happen.
    ``before_read(ck, name)`` runs on the read-ahead worker before its read."""
    real = getattr(Checkpoint, method)
    readers: dict[str, int] = {}
    meet = threading.Barrier(2, timeout=WAIT)

    def spy(self, name):
        readers[name] = threading.get_ident()
        if len(readers) <= 2:
            meet.wait()
        if before_read is not None and threading.current_thread() is not threading.main_thread():
            before_read(self, name)
        return real(self, name)

    monkeypatch.setattr(Checkpoint, method, spy)
    return readers


@pytest.mark.parametrize("compression", [None, "weights"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_bits_read_on_two_threads(tmp_path, monkeypatch, backend, compression):
    path = tmp_path / f"s{SUFFIX[backend]}"
    state = _state()
    ls.save(state, path, compression=compression, chunk_bytes=1 << 17)
    readers = _on_both_threads(monkeypatch)
    got = ls.load_state(path)
    assert len(set(readers.values())) == 2  # both threads read tensors
    assert list(got) == list(state)
    assert_same_state(got, state)


def _damage(path: Path, backend: str, ck: Checkpoint, name: str) -> None:
    """Flip one bit inside the first stored chunk of tensor ``name``."""
    node = ck.stored(name).node
    if backend == "hdf5":
        with h5py.File(path, "r") as f:
            info = f[node].id.get_chunk_info(0)
        target, at = path, info.byte_offset + info.size // 2
    else:
        target = max((p for p in (path / node).rglob("*") if p.is_file()
                      and p.name != "zarr.json"), key=lambda p: p.stat().st_size)
        at = 40  # inside the Blosc frame, after its header
    with open(target, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def _damage_first(path: Path, backend: str
                  ) -> tuple[list[str], Callable[[Checkpoint, str], None]]:
    """(the names damaged, a hook damaging the first tensor it is called for, once)."""
    damaged: list[str] = []

    def damage(ck: Checkpoint, name: str) -> None:
        if not damaged:
            damaged.append(name)
            _damage(path, backend, ck, name)

    return damaged, damage


@pytest.mark.parametrize("backend", BACKENDS)
def test_damaged_frame_read_by_the_worker_raises(tmp_path, monkeypatch, backend):
    """The worker's tensor is damaged just before the worker reads it: the load raises
    IntegrityError naming it, and returns nothing."""
    path = tmp_path / f"s{SUFFIX[backend]}"
    state = {f"w{i}": (np.random.default_rng(i).standard_normal((256, 512)) * 0.02
                       ).astype(np.float32) for i in range(4)}
    ls.save(state, path, compression="weights")
    damaged, damage = _damage_first(path, backend)
    _on_both_threads(monkeypatch, damage)
    with pytest.raises(IntegrityError) as err:
        ls.load_state(path)
    assert damaged and repr(damaged[0]) in str(err.value)
    monkeypatch.undo()
    assert not ls.verify(path).ok


def test_read_all_error_on_the_worker_waits_for_the_caller_and_returns_nothing():
    """The worker fails while the calling thread is mid-read: read_all raises the worker's
    error only once the caller's read is done, and no further tensor is taken."""
    caller_reading = threading.Event()
    worker_failed = threading.Event()
    done: list[str] = []
    running = [0]

    def read(name: str) -> str:
        running[0] += 1
        try:
            if threading.current_thread() is threading.main_thread():
                caller_reading.set()
                assert worker_failed.wait(WAIT)
                done.append(name)
                return name
            # fail only once the caller is mid-read (the worker may start first: failing at
            # once would leave the caller no tensor to finish, as it takes none after an error)
            assert caller_reading.wait(WAIT)
            worker_failed.set()
            raise IntegrityError(f"tensor {name!r}: damaged")
        finally:
            running[0] -= 1

    with pytest.raises(IntegrityError, match="damaged"):
        read_ahead.read_all(["a", "b", "c", "d"], read, sizes=[1 << 28] * 4)
    assert running[0] == 0  # nothing still reading
    assert len(done) == 1  # the caller finished its tensor and took no other one


def test_read_all_error_on_the_caller_waits_for_the_worker():
    worker_started = threading.Event()
    release = threading.Event()
    finished: list[str] = []

    def read(name: str) -> str:
        if threading.current_thread() is threading.main_thread():
            assert worker_started.wait(WAIT)
            release.set()
            raise IntegrityError(f"tensor {name!r}: damaged")
        worker_started.set()
        assert release.wait(WAIT)
        finished.append(name)
        return name

    with pytest.raises(IntegrityError, match="damaged"):
        read_ahead.read_all(["a", "b", "c", "d"], read, sizes=[1 << 28] * 4)
    assert len(finished) == 1  # the worker's read ended before read_all did; no other taken


def test_read_all_small_loads_stay_on_the_calling_thread():
    threads: set[int] = set()

    def read(name: str) -> str:
        threads.add(threading.get_ident())
        return name * 2

    got = read_ahead.read_all(["a", "b", "c"], read,
                              sizes=[1, 2, read_ahead.READ_AHEAD_MIN_BYTES - 4])
    assert got == {"a": "aa", "b": "bb", "c": "cc"}
    assert threads == {threading.get_ident()}


def test_read_all_the_caller_starts_with_the_small_tensors_the_worker_with_the_big():
    """Small reads (short system calls, each giving up the GIL) stay with the caller while the
    worker reads the big ones; whichever is done first takes from the other's share."""
    small, big = read_ahead.SMALL_BYTES - 1, read_ahead.READ_AHEAD_MIN_BYTES
    names = [f"s{i}" for i in range(6)] + [f"b{i}" for i in range(3)] + ["s6", "s7"]
    sizes = [small] * 6 + [big] * 3 + [small] * 2
    order: list[tuple[bool, str]] = []  # (on the caller's thread, name), as read
    worker_read = threading.Event()

    def read(name: str) -> str:
        caller = threading.current_thread() is threading.main_thread()
        order.append((caller, name))
        if caller:
            assert worker_read.wait(WAIT)  # the caller goes on once the worker has read
        else:
            worker_read.set()
        return name.upper()

    got = read_ahead.read_all(names, read, sizes=sizes)
    assert got == {n: n.upper() for n in names} and list(got) == names
    caller = [n for on_caller, n in order if on_caller]
    worker = [n for on_caller, n in order if not on_caller]
    assert caller[0] == "s0" and worker[0] == "b0"
    assert sorted(caller + worker) == sorted(names)
    # each list in its own order: the small ones, then the big ones the caller helped with
    assert [n for n in caller if n.startswith("s")] == sorted(
        n for n in caller if n.startswith("s"))
    assert all(n.startswith("b") for n in worker[:len([n for n in worker if n[0] == "b"])])


def _on_both_threads_verified(monkeypatch, before_read=None) -> dict[str, int]:
    """As :func:`_on_both_threads`, for ``ls.load``'s verified reads."""
    return _on_both_threads(monkeypatch, before_read, "verified_words")


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_into_target_reads_on_two_threads(tmp_path, monkeypatch, backend):
    torch = pytest.importorskip("torch")
    path = tmp_path / f"s{SUFFIX[backend]}"
    gen = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(256, 512, generator=gen).to(dtype)
             for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16,
                                        torch.float32])}
    ls.save(state, path, compression="weights")
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    readers = _on_both_threads_verified(monkeypatch)
    ls.load(target, path)
    assert len(set(readers.values())) == 2
    for k, v in state.items():
        assert torch.equal(target[k].view(torch.int16 if v.element_size() == 2 else torch.int32),
                           v.view(torch.int16 if v.element_size() == 2 else torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_into_target_damage_on_the_worker_changes_nothing(tmp_path, monkeypatch, backend):
    torch = pytest.importorskip("torch")
    path = tmp_path / f"s{SUFFIX[backend]}"
    gen = torch.Generator().manual_seed(4)
    state = {f"w{i}": torch.randn(256, 512, generator=gen) for i in range(4)}
    ls.save(state, path, compression="weights")
    target = {k: torch.full_like(v, 7.0) for k, v in state.items()}
    damaged, damage = _damage_first(path, backend)
    _on_both_threads_verified(monkeypatch, damage)
    with pytest.raises(IntegrityError) as err:
        ls.load(target, path)
    assert damaged and repr(damaged[0]) in str(err.value)
    assert all(bool((t == 7.0).all()) for t in target.values())  # nothing installed
