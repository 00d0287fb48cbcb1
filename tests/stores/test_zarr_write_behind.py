"""Zarr units of host tensors written behind (on the save's workers, several files at once):
the same bytes as the in-order path and as stock zarr, every chunk still checked on read, the
tensors' digests exact, a failure in the middle leaves nothing behind, and the units in flight
stay bounded."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import FakeDeviceSource, without_save_id, zarr_chunk_files, zarr_layout_state

import lean_store as ls
from lean_store import writing
from lean_store.integrity import crc32c_of
from lean_store.sources.numpy_source import ArraySourceTensor
from lean_store.stores.zarr.direct_write import DirectWriter

RNG = np.random.default_rng(11)
STATE = zarr_layout_state(11, several_shards=True)
CHUNK_BYTES = 1024  # 8 rows of 32 float32: tensors of 8+ chunks are sharded


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


class _Spy:
    """Counts the units DirectWriter writes behind, and the most submitted at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_at: int | None = None) -> None:
        self.calls = 0
        self.outstanding = 0
        self.most = 0
        self._lock = threading.Lock()
        real_plain = DirectWriter._write_plain
        real_submitter = writing._submitter

        def write_plain(writer: DirectWriter, path: str, flat: np.ndarray) -> int:
            with self._lock:
                self.calls += 1
                number = self.calls
            if fail_at is not None and number == fail_at:
                raise OSError(28, "No space left on device (injected)")
            return real_plain(writer, path, flat)

        def submitter(pool: Any) -> Any:
            submit = real_submitter(pool)

            def counted(fn: Any, *args: Any) -> Any:
                with self._lock:
                    self.outstanding += 1
                    self.most = max(self.most, self.outstanding)
                future = submit(fn, *args)
                future.add_done_callback(lambda _: self._done())
                return future

            return counted

        monkeypatch.setattr(DirectWriter, "_write_plain", write_plain)
        monkeypatch.setattr(writing, "_submitter", submitter)

    def _done(self) -> None:
        with self._lock:
            self.outstanding -= 1


def test_behind_bytes_equal_in_order_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every unit of every tensor written behind: each file is byte for byte the in-order
    writer's (test_zarr_crc.py pins that one to stock zarr's), stock zarr reads the store, and
    each tensor's digest is the CRC-32C of its words."""
    with monkeypatch.context() as m:
        m.setattr(ArraySourceTensor, "stable_reads", False)  # the in-order path
        ls.save(STATE, tmp_path / "in_order.zarr", chunk_bytes=CHUNK_BYTES)
    spy = _Spy(monkeypatch)
    monkeypatch.setattr(writing, "OVERLAP_CRC_BYTES", 0)  # every unit, however small
    ls.save(STATE, tmp_path / "behind.zarr", chunk_bytes=CHUNK_BYTES)
    assert spy.calls >= 10  # shards of "aligned", "edge", "long", the unsharded chunks
    behind = without_save_id(_files(tmp_path / "behind.zarr"))
    in_order = without_save_id(_files(tmp_path / "in_order.zarr"))
    assert sorted(behind) == sorted(in_order)
    assert [k for k in behind if behind[k] != in_order[k]] == []
    group = zarr.open_group(str(tmp_path / "behind.zarr"), mode="r", zarr_format=3)
    for name in ("aligned", "edge", "long", "small", "unsharded_edge", "mask", "c64"):
        np.testing.assert_array_equal(group[name][...], STATE[name])
    loaded = ls.load_state(tmp_path / "behind.zarr")
    for name, value in STATE.items():
        assert np.asarray(loaded[name]).tobytes() == np.asarray(value).tobytes()
    with ls.open(tmp_path / "behind.zarr") as ck:
        for name in ("aligned", "edge", "long", "unsharded_edge"):
            assert ck.stored(name).attrs["crc32c"] == crc32c_of(STATE[name]), name
        ck.verify()


def test_big_units_go_behind_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Units of 1 MiB and more of host arrays take the path without any setting; a torch
    tensor on the CPU too."""
    torch = pytest.importorskip("torch")
    spy = _Spy(monkeypatch)
    state = {"a": RNG.standard_normal(300_000, dtype=np.float32),  # 1.2 MiB, one unit
             "t": torch.arange(400_000, dtype=torch.float32)}
    ls.save(state, tmp_path / "ck.zarr")
    assert spy.calls == 2
    loaded = ls.load_state(tmp_path / "ck.zarr")
    assert loaded["a"].tobytes() == state["a"].tobytes()
    assert np.asarray(loaded["t"]).tobytes() == state["t"].numpy().tobytes()


def test_corrupt_chunk_written_behind_is_detected(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(monkeypatch)
    monkeypatch.setattr(writing, "OVERLAP_CRC_BYTES", 0)
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path, chunk_bytes=CHUNK_BYTES)
    assert spy.calls
    for name in ("long", "unsharded_edge"):  # a shard, and an unsharded chunk with padding
        unit = zarr_chunk_files(path / name)[0]
        good = unit.read_bytes()
        raw = bytearray(good)
        raw[3] ^= 0x10
        unit.write_bytes(bytes(raw))
        with pytest.raises(ls.IntegrityError):
            ls.load_state(path)
        unit.write_bytes(good)
    assert ls.load_state(path)["long"].tobytes() == STATE["long"].tobytes()


def test_failure_in_the_middle_leaves_nothing(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit whose write fails on a worker fails the save with that error, after every unit
    still in flight has finished: no store, no temporary sibling, nothing written later."""
    spy = _Spy(monkeypatch, fail_at=4)
    monkeypatch.setattr(writing, "OVERLAP_CRC_BYTES", 0)
    path = tmp_path / "ck.zarr"
    with pytest.raises(ls.CheckpointError, match="No space left"):
        ls.save(STATE, path, chunk_bytes=CHUNK_BYTES)
    assert spy.calls >= 4
    assert spy.outstanding == 0
    assert list(tmp_path.iterdir()) == []
    # a previous checkpoint at the path survives a failed save untouched
    monkeypatch.undo()
    ls.save({"x": np.arange(3)}, path)
    before = _files(path)
    _Spy(monkeypatch, fail_at=2)
    monkeypatch.setattr(writing, "OVERLAP_CRC_BYTES", 0)
    with pytest.raises(ls.CheckpointError, match="No space left"):
        ls.save(STATE, path, chunk_bytes=CHUNK_BYTES)
    assert _files(path) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck.zarr"]


def test_units_in_flight_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most WRITE_BEHIND_BYTES of units (two units at least) are handed to the workers at
    once: copies of non-contiguous sources stay within the save's memory bound."""
    spy = _Spy(monkeypatch)
    monkeypatch.setattr(writing, "OVERLAP_CRC_BYTES", 0)
    monkeypatch.setattr(writing, "WRITE_BEHIND_BYTES", 3 * 4096)
    state = {f"t{i}": RNG.standard_normal(1024, dtype=np.float32) for i in range(40)}  # 4 KiB
    ls.save(state, tmp_path / "ck.zarr", chunk_bytes=4096)
    assert spy.calls == 40
    assert 1 <= spy.most <= 3
    loaded = ls.load_state(tmp_path / "ck.zarr")
    assert all(loaded[k].tobytes() == v.tobytes() for k, v in state.items())
    monkeypatch.setattr(writing, "WRITE_BEHIND_BYTES", 1)  # still two, so both workers write
    spy.most = 0
    ls.save(state, tmp_path / "two.zarr", chunk_bytes=4096)
    assert spy.most <= 2


def test_tensors_closed_in_save_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small tensors written in order and big ones behind, interleaved: each tensor is closed
    (its document written with its digest) after its own units only, in save order."""
    monkeypatch.setattr(writing, "OVERLAP_CRC_BYTES", 2048)
    state: dict[str, np.ndarray] = {}
    for i in range(12):
        n = 4096 if i % 3 else 16  # 16 KiB behind, 64 B in order
        state[f"t{i:02d}"] = RNG.standard_normal(n, dtype=np.float32)
    _Spy(monkeypatch)
    ls.save(state, tmp_path / "ck.zarr", chunk_bytes=4096)
    with ls.open(tmp_path / "ck.zarr") as ck:
        assert list(ck.layout.names()) == list(state)
        for name, value in state.items():
            assert ck.stored(name).attrs["crc32c"] == crc32c_of(value)
        ck.verify()


@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_staged_device_units_are_written_in_order(tmp_path: Path, suffix: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Units staged through the pooled host buffers (device tensors) are never written
    behind: their buffer is reused as soon as the next unit is asked for."""
    spy = _Spy(monkeypatch)
    monkeypatch.setattr(writing, "OVERLAP_CRC_BYTES", 0)
    arrays = {f"w{i}": RNG.standard_normal((512, 1024), dtype=np.float32) for i in range(3)}
    path = tmp_path / f"ck{suffix}"
    # 1 MiB chunks (HDF5: allocated at creation, as for units written behind), 2 buffers
    writing.write_source(FakeDeviceSource(arrays), path, kind="state", chunk_bytes=1 << 20,
                         buffer_bytes=2 << 20)
    assert spy.calls == 0 and spy.most == 0  # nothing handed to the workers whole
    back = ls.load_state(path)
    for name, value in arrays.items():
        assert back[name].tobytes() == value.tobytes()
