"""``compression="weights"`` chunks of a stable source (host arrays, whose memory stays
unchanged for the whole save) are compressed from the source's memory itself, on the save's
workers, with no copy first (issue 15's save speed); the bytes are those of the in-order
path, which copies; units staged through reused buffers (device tensors) are still copied."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from helpers import FakeDeviceSource, without_save_id, zarr_layout_state

import lean_store as ls
from lean_store import writing
from lean_store.sources.numpy_source import ArraySourceTensor
from lean_store.stores.hdf5 import blosc as hdf5_blosc
from lean_store.stores.zarr.direct_write import BloscSettings

RNG = np.random.default_rng(15)


class _Compressed:
    """Records, for each chunk Blosc compresses, whether it shares memory with ``sources``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, sources: list[np.ndarray]) -> None:
        self.shared: list[bool] = []
        self._lock = threading.Lock()
        real_hdf5 = hdf5_blosc._encode
        real_zarr = BloscSettings.compress

        def seen(chunk: np.ndarray) -> None:
            with self._lock:
                self.shared.append(any(np.shares_memory(chunk, s) for s in sources))

        def hdf5_encode(chunk: np.ndarray, *args: Any) -> Any:
            seen(chunk)
            return real_hdf5(chunk, *args)

        def zarr_compress(settings: BloscSettings, chunk: np.ndarray) -> bytes:
            seen(chunk)
            return real_zarr(settings, chunk)

        monkeypatch.setattr(hdf5_blosc, "_encode", hdf5_encode)
        monkeypatch.setattr(BloscSettings, "compress", zarr_compress)


def _state() -> dict[str, np.ndarray]:
    """Tensors of whole 1 MiB chunks (float32, bfloat16-like uint16 words, 1-byte words),
    one of several chunks, and one with an edge chunk (padded: a copy either way)."""
    return {
        "one": RNG.standard_normal((256, 1024), dtype=np.float32),
        "many": RNG.standard_normal((1024, 1024), dtype=np.float32),
        "half": (RNG.standard_normal((512, 1024)) * 2**15).astype(np.int16).view(np.uint16),
        "bytes": RNG.integers(0, 256, (1024, 1024), dtype=np.uint8),
        "edge": RNG.standard_normal((300, 1024), dtype=np.float32),
    }


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_stable_chunks_compressed_without_a_copy(tmp_path: Path, suffix: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every whole chunk of a host state reaches Blosc as a view of the state's own memory
    (before: each was copied for the pool), and the state comes back exactly."""
    state = _state()
    spy = _Compressed(monkeypatch, list(state.values()))
    path = tmp_path / f"ck{suffix}"
    ls.save(state, path, compression="weights", chunk_bytes=1 << 20)
    whole = 1 + 4 + 1 + 1  # chunks not at an array's edge
    assert spy.shared.count(True) >= whole
    back = ls.load_state(path)
    for name, value in state.items():
        assert back[name].tobytes() == value.tobytes(), name
    assert ls.verify(path).ok


def _hdf5_chunks(path: Path) -> dict[str, list[tuple[int, bytes]]]:
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset) and obj.chunks is not None:
                out[name] = [obj.id.read_direct_chunk(info.chunk_offset)
                             for info in (obj.id.get_chunk_info(i)
                                          for i in range(obj.id.get_num_chunks()))]
        f.visititems(visit)
    return out


def test_stable_chunks_bytes_equal_in_order_path(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The stored chunks and Zarr files are byte for byte those of the in-order path (each
    chunk copied, then compressed on the pool), on both backends."""
    state = {**_state(), **{k: v for k, v in zarr_layout_state(15).items()
                            if np.asarray(v).dtype.itemsize <= 8}}
    for suffix in (".h5", ".zarr"):
        with monkeypatch.context() as m:
            m.setattr(ArraySourceTensor, "stable_reads", False)  # the in-order path
            ls.save(state, tmp_path / f"in_order{suffix}", compression="weights",
                    chunk_bytes=1 << 20)
        ls.save(state, tmp_path / f"behind{suffix}", compression="weights", chunk_bytes=1 << 20)
    assert _hdf5_chunks(tmp_path / "behind.h5") == _hdf5_chunks(tmp_path / "in_order.h5")

    def files(root: Path) -> dict[str, bytes]:
        return without_save_id({str(p.relative_to(root)): p.read_bytes()
                                for p in root.rglob("*") if p.is_file()})

    behind, in_order = files(tmp_path / "behind.zarr"), files(tmp_path / "in_order.zarr")
    assert sorted(behind) == sorted(in_order)
    assert [k for k in behind if behind[k] != in_order[k]] == []
    for suffix in (".h5", ".zarr"):
        back = ls.load_state(tmp_path / f"behind{suffix}")
        for name, value in state.items():
            assert np.asarray(back[name]).tobytes() == np.asarray(value).tobytes(), name


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_staged_units_still_copied(tmp_path: Path, suffix: str) -> None:
    """Units staged through two reused host buffers are compressed from copies: the buffers
    are overwritten by the next units while the pool still compresses, and every tensor
    still comes back exactly."""
    arrays = {f"w{i}": RNG.standard_normal((256, 1024), dtype=np.float32) for i in range(6)}
    path = tmp_path / f"ck{suffix}"
    writing.write_source(FakeDeviceSource(arrays), path, kind="state", chunk_bytes=1 << 20,
                         buffer_bytes=2 << 20, compression="weights")
    back = ls.load_state(path)
    for name, value in arrays.items():
        assert back[name].tobytes() == value.tobytes(), name
