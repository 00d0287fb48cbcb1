"""HDF5 chunks of host tensors written behind: datasets of unfiltered chunks get their chunk
space at creation, and the save's workers write each chunk of 1 MiB or more at its offset
(with its CRC-32C), smaller ones in batches (``small_writes``), while HDF5 goes on with the
next datasets. The chunks' bytes are those
H5Dwrite_chunk writes, every chunk is still checked on read, a failure leaves nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from h5py import h5d

import lean_store as ls
from lean_store import writing
from lean_store.integrity import crc32c_of
from lean_store.sources.numpy_source import ArraySourceTensor
from lean_store.stores.hdf5 import small_writes
from lean_store.stores.hdf5 import store as hdf5_store

RNG = np.random.default_rng(5)
MIB = 1 << 20
STATE = {
    "one": RNG.standard_normal(MIB // 4, dtype=np.float32),  # one 1 MiB chunk
    "rows": RNG.standard_normal((1000, 1024), dtype=np.float32),  # 4 chunks, the last clipped
    "edge": RNG.standard_normal(700_001, dtype=np.float32),  # 3 chunks, padded edge chunk
    "halves": RNG.standard_normal((1100, 512)).astype(np.float16),  # 2 chunks of float16
    "small": np.arange(10.0),  # chunks under 1 MiB: written in a batch
    "scalar": np.float64(2.5),
}


def _chunks(path: Path) -> dict[str, tuple[Any, list[bytes]]]:
    """Per dataset: (its chunk_crc32c table, each chunk's stored bytes in order)."""
    out = {}
    with h5py.File(path, "r") as f:
        for name, ds in f.items():
            chunks = []
            for i in range(ds.id.get_num_chunks()):
                info = ds.id.get_chunk_info(i)
                chunks.append(ds.id.read_direct_chunk(info.chunk_offset)[1])
            out[name] = (list(ds.attrs["chunk_crc32c"]), chunks)
    return out


class _Spy:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_at: int | None = None) -> None:
        self.calls = 0
        self.threads: set[str] = set()
        self._lock = threading.Lock()
        real = hdf5_store.HDF5TensorWriter._write_at

        def write_at(writer: Any, number: int, offset: int, data: np.ndarray) -> int:
            with self._lock:
                self.calls += 1
                self.threads.add(threading.current_thread().name)
                call = self.calls
            if call == fail_at:
                raise OSError(5, "Input/output error (injected)")
            return real(writer, number, offset, data)

        monkeypatch.setattr(hdf5_store.HDF5TensorWriter, "_write_at", write_at)
        self.small = 0  # chunks under 1 MiB, written in batches
        real_batch = small_writes._write_batch

        def write_batch(fd: int, items: list[Any]) -> int:
            with self._lock:
                self.small += len(items)
                self.threads.add(threading.current_thread().name)
            return real_batch(fd, items)

        monkeypatch.setattr(small_writes, "_write_batch", write_batch)


def _save_in_order(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        m.setattr(ArraySourceTensor, "stable_reads", False)  # every chunk by H5Dwrite_chunk
        ls.save(STATE, path, chunk_bytes=MIB)


def test_chunks_written_behind_equal_in_order(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _save_in_order(tmp_path / "in_order.h5", monkeypatch)
    spy = _Spy(monkeypatch)
    ls.save(STATE, tmp_path / "behind.h5", chunk_bytes=MIB)
    assert spy.calls == 1 + 3 + 2 + 1  # whole 1 MiB chunks, each on its own
    assert spy.small == 1 + 1 + 1 + 1 + 1  # the clipped and edge chunks, small and scalar
    assert all(name.startswith("lean_store-crc") for name in spy.threads)
    behind, in_order = _chunks(tmp_path / "behind.h5"), _chunks(tmp_path / "in_order.h5")
    assert behind == in_order  # tables and every chunk's bytes, edge padding included
    with h5py.File(tmp_path / "behind.h5", "r") as f:
        for name, value in STATE.items():
            assert f[name][...].tobytes() == np.asarray(value).tobytes(), name
        alloc = {n: f[n].id.get_create_plist().get_alloc_time() for n in f}
    assert set(alloc.values()) == {h5d.ALLOC_TIME_EARLY}
    loaded = ls.load_state(tmp_path / "behind.h5")
    for name, value in STATE.items():
        assert np.asarray(loaded[name]).tobytes() == np.asarray(value).tobytes()
    with ls.open(tmp_path / "behind.h5") as ck:
        for name in ("one", "rows", "edge", "halves"):
            assert ck.stored(name).attrs["crc32c"] == crc32c_of(STATE[name]), name
        ck.verify()


def test_every_chunk_on_its_own_equals_in_order(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Units of any size written behind one by one (``_write_at`` pads the edge chunks)."""
    _save_in_order(tmp_path / "in_order.h5", monkeypatch)
    spy = _Spy(monkeypatch)
    monkeypatch.setattr(writing, "OVERLAP_CRC_BYTES", 0)
    ls.save(STATE, tmp_path / "behind.h5", chunk_bytes=MIB)
    assert (spy.calls, spy.small) == (1 + 4 + 3 + 2 + 1 + 1, 0)
    assert _chunks(tmp_path / "behind.h5") == _chunks(tmp_path / "in_order.h5")
    ls.verify(tmp_path / "behind.h5").raise_if_bad()


@pytest.mark.skipif(shutil.which("h5dump") is None, reason="h5dump is not installed")
def test_h5dump_reads_chunks_written_behind(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(monkeypatch)
    path = tmp_path / "ck.h5"
    ls.save({"edge": STATE["edge"]}, path, chunk_bytes=MIB)
    assert (spy.calls, spy.small) == (2, 1)  # the padded edge chunk in a batch
    for at in (0, 300_000, 700_000):
        out = subprocess.run(["h5dump", "-d", "/edge", "-s", str(at), "-c", "1", str(path)],
                             capture_output=True, text=True, check=True).stdout
        assert f"({at}): {STATE['edge'][at]:.6g}" in out, out[:400]


def test_corrupt_chunk_written_behind_is_detected(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(monkeypatch)
    path = tmp_path / "ck.h5"
    ls.save(STATE, path, chunk_bytes=MIB)
    assert spy.calls
    with h5py.File(path, "r") as f:
        offset = f["rows"].id.get_chunk_info(2).byte_offset
    raw = bytearray(path.read_bytes())
    raw[offset + 100] ^= 0x08
    path.write_bytes(bytes(raw))
    with pytest.raises(ls.IntegrityError, match="rows"):
        ls.load_state(path)
    with ls.open(path) as ck:
        assert ck.read_bits("one").tobytes() == STATE["one"].tobytes()  # others still read


def test_failure_in_the_middle_leaves_nothing(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    ls.save({"x": np.arange(3)}, tmp_path / "ck.h5")
    before = (tmp_path / "ck.h5").read_bytes()
    _Spy(monkeypatch, fail_at=5)
    with pytest.raises(ls.CheckpointError, match="Input/output error"):
        ls.save(STATE, tmp_path / "ck.h5", chunk_bytes=MIB)
    assert (tmp_path / "ck.h5").read_bytes() == before
    _Spy(monkeypatch, fail_at=3)  # counts afresh
    with pytest.raises(ls.CheckpointError, match="Input/output error"):
        ls.save(STATE, tmp_path / "new.h5", chunk_bytes=MIB)
    assert [p.name for p in tmp_path.iterdir()] == ["ck.h5"]


def test_a_failed_batch_of_small_chunks_leaves_nothing(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ls.save({"x": np.arange(3)}, tmp_path / "ck.h5")
    before = (tmp_path / "ck.h5").read_bytes()
    calls = []

    def failing(fd: int, items: list[Any]) -> int:
        calls.append(len(items))
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(small_writes, "_write_batch", failing)
    many = {f"n{i}": np.full(3000, i, np.float32) for i in range(200)}  # ~2.4 MB: 2 batches
    for target in ("ck.h5", "new.h5"):
        with pytest.raises(ls.CheckpointError, match="No space left"):
            ls.save(many, tmp_path / target)
    assert len(calls) >= 2
    assert (tmp_path / "ck.h5").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck.h5"]


def test_many_small_tensors_written_in_batches_read_back(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(monkeypatch)
    rng = np.random.default_rng(3)
    state = {f"b{i}.{k}": rng.standard_normal(n, dtype=np.float32)
             for i in range(60) for k, n in (("w", 40_000), ("b", 256), ("s", 1))}
    state["big"] = rng.standard_normal(3 * MIB // 4, dtype=np.float32)  # 3 whole chunks
    ls.save(state, tmp_path / "ck.h5", chunk_bytes=MIB)
    assert spy.small == 180 and spy.calls == 3
    back = ls.load_state(tmp_path / "ck.h5")
    assert all(back[k].tobytes() == v.tobytes() for k, v in state.items())
    ls.verify(tmp_path / "ck.h5").raise_if_bad()
    with h5py.File(tmp_path / "ck.h5", "r") as f:  # h5py reads them as HDF5 wrote them
        assert all(f[k][...].tobytes() == v.tobytes() for k, v in state.items())


def test_pwrite_all_resumes_short_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short pwritev (a signal, a nearly full disk) is resumed where it stopped."""
    real = small_writes.os.pwritev

    def short(fd: int, views: list[Any], offset: int) -> int:
        first = memoryview(views[0])
        return real(fd, [first[: max(1, first.nbytes // 3)]], offset)

    monkeypatch.setattr(small_writes.os, "pwritev", short)
    pieces = [np.arange(1000, dtype=np.uint8), np.zeros(0, np.uint8), np.full(7, 9, np.uint8)]
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    fd = os.open(path, os.O_RDWR)
    try:
        small_writes.pwrite_all(fd, pieces, 5)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"x" * 5 + bytes(pieces[0]) + bytes(pieces[2])


def test_batches_in_flight_are_bounded(tmp_path: Path) -> None:
    """The caller waits for the oldest batch before it hands off one more than
    ``MAX_BATCHES``: copies of non-contiguous chunks cannot pile up on a slow disk."""
    from concurrent.futures import ThreadPoolExecutor

    gate = threading.Event()
    most = [0]
    running = [0]
    lock = threading.Lock()

    def slow(fn: Any, *args: Any) -> Any:
        def run() -> Any:
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            gate.wait(0.05)
            try:
                return fn(*args)
            finally:
                with lock:
                    running[0] -= 1
        return pool.submit(run)

    path = tmp_path / "f"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDWR)
    chunk = np.full(small_writes.BATCH_BYTES, 7, np.uint8)
    try:
        with ThreadPoolExecutor(32) as pool:
            writes = small_writes.SmallChunkWrites(fd)
            for i in range(3 * small_writes.MAX_BATCHES):
                writes.add(i * chunk.size, chunk, 0, slow)
                assert len(writes._pending) <= small_writes.MAX_BATCHES
            writes.finish()
    finally:
        os.close(fd)
    assert most[0] <= small_writes.MAX_BATCHES
    assert path.stat().st_size == 3 * small_writes.MAX_BATCHES * chunk.size
