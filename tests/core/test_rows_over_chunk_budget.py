"""Tensors whose rows exceed the chunk budget: ``plan_chunks`` then cuts the last axis too
(``(1, 256)`` chunks of a ``(600, 1000)`` float32 array at ``chunk_bytes=1024``). Such saves
used to be unreadable: Zarr grew its shards along the first axis (``(8, 256)`` blocks of eight
rows), whose units are not contiguous runs of the tensor, and wrote wrong bytes under a digest
that caught them only on load; HDF5 refused its own chunk table as "re-chunked". Every save
must load bit for bit, verify, and read the same through h5py and zarr-python."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr

import lean_store as ls
from lean_store.chunking import grow_chunks, plan_chunks
from lean_store.stores.hdf5.crc_table import is_row_block

CASES = [  # (shape, dtype, chunk_bytes)
    ((600, 1000), np.float32, 1024),
    ((3, 5, 700), np.float32, 1024),
    ((7, 300), np.float64, 1024),
    ((2, 3, 4, 1000), np.float32, 2048),
    ((40, 3000), np.uint8, 1024),
]


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"t{i}": rng.integers(0, 255, size=int(np.prod(shape)) * np.dtype(dt).itemsize,
                                  dtype=np.uint8).view(dt).reshape(shape)
            for i, (shape, dt, _) in enumerate(CASES)}


@pytest.mark.parametrize("chunk_bytes", sorted({c for _, _, c in CASES}))
@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_rows_over_the_budget_save_and_load_exactly(tmp_path: Path, suffix: str,
                                                    chunk_bytes: int) -> None:
    state = _state(chunk_bytes)
    path = tmp_path / f"ck{suffix}"
    ls.save(state, path, chunk_bytes=chunk_bytes)
    back = ls.load_state(path)
    for name, value in state.items():
        assert back[name].tobytes() == value.tobytes(), name
    assert ls.verify(path).ok
    with ls.open(path) as ck:  # a partial read across the cut rows
        part = np.asarray(ck["t0"][10:20, 100:900])
        assert part.tobytes() == state["t0"][10:20, 100:900].tobytes()
    if suffix == ".h5":
        with h5py.File(path, "r") as f:
            for name, value in state.items():
                assert f[name][...].tobytes() == value.tobytes(), name
    else:
        group = zarr.open_group(str(path), mode="r")
        for name, value in state.items():
            assert group[name][...].tobytes() == value.tobytes(), name


@pytest.mark.parametrize("shape, dtype, chunk_bytes", CASES)
def test_planned_chunks_and_shards_are_row_blocks(shape, dtype, chunk_bytes) -> None:
    chunks = plan_chunks(shape, np.dtype(dtype).itemsize, chunk_bytes)
    assert chunks[-1] < shape[-1]  # the case at hand: the last axis is cut
    shards = grow_chunks(shape, chunks, 8)
    for block in (chunks, shards):  # ones, then the cut (last) axis, then nothing
        assert is_row_block(shape, block), block
        assert all(c == 1 for c in block[:-1]), block


def test_row_block_is_told_by_the_last_cut_axis() -> None:
    assert is_row_block((600, 1000), (1, 256))
    assert is_row_block((600, 1000), (8, 1000))
    assert is_row_block((600, 1000), (600, 1000))
    assert not is_row_block((600, 1000), (8, 256))  # eight rows of a quarter: not contiguous
    assert not is_row_block((600, 1000), (600, 256))
    assert grow_chunks((600, 1000), (1, 256), 8) == (1, 1024)
    assert grow_chunks((600, 1000), (8, 1000), 8) == (64, 1000)
