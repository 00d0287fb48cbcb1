"""HDF5 whole-tensor reads: chunks read with one pread from their offset, each checked in a
worker thread while the next is read, and never handed out before their check passed."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

import lean_store as ls
from lean_store.stores.hdf5.store import HDF5Reader

MiB = 1 << 20


def _save(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    state = {"w": rng.random((1024, 1024), dtype=np.float32), "e": rng.random((700, 1000),
                                                                               dtype=np.float32)}
    path = tmp_path / "x.h5"
    ls.save(state, path, chunk_bytes=MiB)  # 1 MiB chunks: read ahead and checked in a thread
    return path, state


def _flip(path: Path, node: str, coords: tuple[int, ...]) -> None:
    with h5py.File(path, "r") as f:
        ds = f[node]
        start = tuple(c * n for c, n in zip(coords, ds.chunks))
        offset = ds.id.get_chunk_info_by_coord(start).byte_offset
    with open(path, "r+b") as fh:
        fh.seek(offset + 123)
        byte = fh.read(1)
        fh.seek(offset + 123)
        fh.write(bytes([byte[0] ^ 0x40]))


def test_values_and_pread_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, state = _save(tmp_path)
    calls = []
    orig = HDF5Reader._pread_chunk

    def spy(self: HDF5Reader, *args: object) -> bool:
        calls.append(orig(self, *args))  # type: ignore[arg-type]
        return calls[-1]

    monkeypatch.setattr(HDF5Reader, "_pread_chunk", spy)
    out = ls.load_state(path)
    for name, value in state.items():
        assert np.array_equal(out[name], value)
    assert calls and all(calls)
    with ls.open(path) as ck:
        assert np.array_equal(ck["e"][3:650:9, 5::7], state["e"][3:650:9, 5::7])
        ck.verify()


def test_bad_chunk_never_handed_out(tmp_path: Path) -> None:
    path, state = _save(tmp_path)
    _flip(path, "w", (2, 0))
    with ls.open(path) as ck:
        seen = []
        with pytest.raises(ls.IntegrityError, match=r"'w'.*chunk \(2, 0\)"):
            for region, _ in ck.blocks("w", reuse=True):
                seen.append(region[0].start)
        assert seen == [0, 256]  # chunks 0 and 1 only
    target = {k: np.zeros_like(v) for k, v in state.items()}
    with pytest.raises(ls.IntegrityError, match=r"chunk \(2, 0\)"):
        ls.load(target, path)
    assert not any(np.any(v) for v in target.values())
    with pytest.raises(ls.IntegrityError, match=r"chunk \(2, 0\)"):
        ls.load_state(path)


def test_edge_chunk_corruption(tmp_path: Path) -> None:
    path, _ = _save(tmp_path)
    _flip(path, "e", (2, 0))  # the last, clipped chunk of 'e'
    with pytest.raises(ls.IntegrityError, match=r"'e'.*chunk \(2, 0\)"):
        ls.load_state(path)
