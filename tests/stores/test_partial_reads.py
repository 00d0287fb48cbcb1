"""Partial reads touch only the chunks the slice needs, in both backends (bytes counted)."""

from __future__ import annotations

import numpy as np
import pytest
from counting import CountingFile, CountingStore

import lean_store as ls

ROWS, COLS = 64, 1024  # float32: 4 KiB per row
CHUNK_BYTES = 4 * COLS * 4  # 4 rows = 16 KiB per chunk -> 16 chunks


@pytest.fixture
def weights():
    return np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)


def test_hdf5_slice_reads_only_touched_chunks(tmp_path, weights):
    path = tmp_path / "w.h5"
    ls.save({"w": weights}, path, chunk_bytes=CHUNK_BYTES)
    with CountingFile(path, "r") as raw, ls.open(raw, backend="hdf5") as ck:
        assert ck["w"].chunks == (4, COLS)
        CountingFile.bytes_read = 0
        part = ck["w"][10:12, 100:200:3]
        one_chunk = CountingFile.bytes_read
        np.testing.assert_array_equal(part, weights[10:12, 100:200:3])
        CountingFile.bytes_read = 0
        ck["w"][6:10]  # rows 6..9 span chunks 1 and 2
        two_chunks = CountingFile.bytes_read
        CountingFile.bytes_read = 0
        np.testing.assert_array_equal(ck["w"][::-1, -3], weights[::-1, -3])
        everything = CountingFile.bytes_read
    chunk = 4 * COLS * 4
    assert chunk <= one_chunk < 2 * chunk  # one chunk plus a little index metadata
    assert 2 * chunk <= two_chunks < 3 * chunk
    assert everything >= ROWS * COLS * 4


@pytest.mark.parametrize("sharded", [False, True])
def test_zarr_slice_reads_only_touched_chunks(tmp_path, weights, sharded):
    path = tmp_path / "w.zarr"
    state = {"w": weights if sharded else weights[:28]}  # 7 chunks stay unsharded
    ls.save(state, path, chunk_bytes=CHUNK_BYTES)
    store = CountingStore(path, read_only=True)
    with ls.open(store, backend="zarr") as ck:
        CountingStore.fetched = []
        part = ck["w"][10:12, 100:200:3]
        np.testing.assert_array_equal(part, state["w"][10:12, 100:200:3])
        data_keys = [(k, n) for k, n in CountingStore.fetched if not k.endswith("zarr.json")]
    chunk = 4 * COLS * 4
    fetched_bytes = sum(n for _, n in data_keys)
    assert chunk <= fetched_bytes < chunk + 4096  # one inner chunk (+ a shard index if sharded)
    assert len({k for k, _ in data_keys}) == 1


def test_scalar_and_ellipsis_indexing(tmp_path):
    path = tmp_path / "s.h5"
    cube = np.arange(60, dtype=np.int16).reshape(3, 4, 5)
    ls.save({"s": np.array(2.5), "c": cube}, path)
    with ls.open(path) as ck:
        assert ck["s"][()] == 2.5 and ck["s"][...].shape == ()
        for key in [
            (..., 1),
            (1, ...),
            (slice(None), -1, slice(None, None, -2)),
            (-1, 2, 4),
            (slice(5, 1, -1),),
            (slice(0, 0),),
        ]:
            np.testing.assert_array_equal(ck["c"][key], cube[key])
