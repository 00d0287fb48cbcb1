"""Partial reads through the default fast paths touch only the chunks a selection needs.

``test_partial_reads.py`` counts bytes through a file object (HDF5) or a zarr ``LocalStore``
subclass, and both switch lean_store's fast paths off. Here checkpoints are opened by plain
path, as users open them: an unfiltered HDF5 chunk is read with one ``preadv`` at its file
offset from the descriptor HDF5 holds (sec2 driver); a Zarr chunk of lean_store's own
uncompressed layout with one ``preadv`` from its chunk or shard file, opened relative to the
store's pinned directory (``dir_fd``), after one ``pread`` of the shard index. Each test records
those calls and checks they name exactly the touched chunks, and bounds the bytes the whole
process read during the call (``rchar`` of ``/proc/self/io``), so that nothing read more
behind the fast path's back. Compressed checkpoints, which take HDF5's and zarr's pipelines,
are bounded the same way: one stored chunk, never two.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr.storage
from helpers import zarr_chunk_files

import lean_store as ls

ROWS, COLS = 64, 1024  # float32: 4 KiB per row
CHUNK = 4 * COLS * 4  # chunk_bytes: 4 rows = 16 KiB per chunk -> 16 chunks
CRC = 4  # a Zarr chunk's trailing crc32c
SLACK = 4096  # reads besides the chunks: /proc/self/io itself (~100 bytes), no second chunk
PROC_IO = Path("/proc/self/io")


def bytes_read_by_process() -> int:
    """Bytes this process has read with read-like system calls so far (every thread)."""
    for line in PROC_IO.read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar line in /proc/self/io")


class Reads:
    """Records the ``os.preadv``, ``os.pread`` and ``os.open(..., dir_fd=...)`` calls made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple] = []
        preadv, pread, open_ = os.preadv, os.pread, os.open

        def counting_preadv(fd, buffers, offset, *flags):
            got = preadv(fd, buffers, offset, *flags)
            self.calls.append(("preadv", offset, sum(memoryview(b).nbytes for b in buffers)))
            return got

        def counting_pread(fd, n, offset):
            self.calls.append(("pread", offset, n))
            return pread(fd, n, offset)

        def counting_open(path, flags, mode=0o777, *, dir_fd=None):
            if dir_fd is not None:
                self.calls.append(("open", os.fsdecode(path)))
            return open_(path, flags, mode, dir_fd=dir_fd)

        monkeypatch.setattr(os, "preadv", counting_preadv)
        monkeypatch.setattr(os, "pread", counting_pread)
        monkeypatch.setattr(os, "open", counting_open)

    def during(self, read):
        """(result of ``read()``, calls it made, bytes the process read meanwhile)."""
        self.calls = []
        before = bytes_read_by_process()
        result = read()
        return result, self.calls, bytes_read_by_process() - before


@pytest.fixture
def reads(monkeypatch) -> Reads:
    if not PROC_IO.exists():
        pytest.skip("needs /proc/self/io (Linux) to count the bytes a read makes")
    return Reads(monkeypatch)


@pytest.fixture
def weights() -> np.ndarray:
    return np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)


@pytest.fixture
def noise() -> np.ndarray:
    """Weights that compress little: every compressed chunk stays far bigger than SLACK."""
    return np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)


def hdf5_chunks(path: Path) -> list[tuple[int, int]]:
    """(file offset, stored size) of each chunk of the file's one dataset, in row order."""
    with h5py.File(path, "r") as f:
        (ds,) = f.values()
        dsid = ds.id
        infos = [dsid.get_chunk_info(i) for i in range(dsid.get_num_chunks())]
    return [(i.byte_offset, i.size) for i in sorted(infos, key=lambda i: i.chunk_offset)]


def zarr_shard_index(shard: Path, slots: int) -> np.ndarray:
    """(offset, nbytes) per inner chunk, from the index at the end of a shard file."""
    raw = shard.read_bytes()[-(16 * slots + CRC):-CRC]
    return np.frombuffer(raw, "<u8").reshape(slots, 2)


def zarr_inner_chunks_per_shard(store: Path) -> int:
    doc = json.loads((store / "w" / "zarr.json").read_text())
    outer = doc["chunk_grid"]["configuration"]["chunk_shape"]
    (sharding,) = [c for c in doc["codecs"] if c["name"] == "sharding_indexed"]
    inner = sharding["configuration"]["chunk_shape"]
    return int(np.prod([o // i for o, i in zip(outer, inner)]))


# ------------------------------------------------------------------------------------ HDF5


def test_hdf5_plain_path_preads_only_the_touched_chunks(tmp_path, weights, reads):
    path = tmp_path / "w.h5"
    ls.save({"w": weights}, path, chunk_bytes=CHUNK)
    chunks = hdf5_chunks(path)
    assert len(chunks) == 16 and all(size == CHUNK for _, size in chunks)
    with ls.open(path) as ck:
        ck["w"][0:1, 0:1]  # the first read loads the manifest and the CRC table
        part, calls, nbytes = reads.during(lambda: ck["w"][10:12, 100:200:3])
        np.testing.assert_array_equal(part, weights[10:12, 100:200:3])
        assert calls == [("preadv", chunks[2][0], CHUNK)]  # rows 8-11, read whole, once
        assert CHUNK <= nbytes < CHUNK + SLACK

        part, calls, nbytes = reads.during(lambda: ck["w"][6:10])  # chunks 1 and 2
        np.testing.assert_array_equal(part, weights[6:10])
        assert calls == [("preadv", chunks[1][0], CHUNK), ("preadv", chunks[2][0], CHUNK)]
        assert 2 * CHUNK <= nbytes < 2 * CHUNK + SLACK

        whole, calls, nbytes = reads.during(lambda: ck["w"].read())  # the read-ahead path
        np.testing.assert_array_equal(whole, weights)
        assert sorted(calls) == sorted(("preadv", offset, CHUNK) for offset, _ in chunks)
        assert ROWS * COLS * 4 <= nbytes < ROWS * COLS * 4 + SLACK


def test_hdf5_through_a_file_object_takes_no_fast_path(tmp_path, weights, reads):
    """Why the tests above exist: opened through a file object, HDF5 reads every chunk
    through that object and never with lean_store's pread."""
    path = tmp_path / "w.h5"
    ls.save({"w": weights}, path, chunk_bytes=CHUNK)
    with io.FileIO(path, "r") as raw, ls.open(raw, backend="hdf5") as ck:
        part, calls, _ = reads.during(lambda: ck["w"][10:12])
    np.testing.assert_array_equal(part, weights[10:12])
    assert calls == []


def test_hdf5_compressed_plain_path_reads_one_stored_chunk(tmp_path, noise, reads):
    path = tmp_path / "w.h5"
    ls.save({"w": noise}, path, chunk_bytes=CHUNK, compression="weights")
    chunks = hdf5_chunks(path)
    assert min(size for _, size in chunks) > SLACK  # so that a second chunk would show
    with ls.open(path) as ck:
        ck["w"][0:1, 0:1]
        part, calls, nbytes = reads.during(lambda: ck["w"][10:12, 100:200:3])
    np.testing.assert_array_equal(part, noise[10:12, 100:200:3])
    offset, stored = chunks[2]
    # Blosc chunks: lean_store reads the one stored chunk itself and decompresses it
    assert calls == [("preadv", offset, stored)]
    assert stored < CHUNK  # really compressed
    assert stored <= nbytes < stored + SLACK


# ------------------------------------------------------------------------------------ Zarr


def test_zarr_plain_path_reads_one_chunk_file(tmp_path, weights, reads):
    path = tmp_path / "w.zarr"
    state = weights[:28]  # 7 chunks: below the sharding threshold, one file per chunk
    ls.save({"w": state}, path, chunk_bytes=CHUNK)
    assert [p.name for p in zarr_chunk_files(path / "w")] == [f"c.{i}.0" for i in range(7)]
    with ls.open(path) as ck:
        ck["w"][0:1, 0:1]
        part, calls, nbytes = reads.during(lambda: ck["w"][10:12, 100:200:3])
        np.testing.assert_array_equal(part, state[10:12, 100:200:3])
        # one byte more than the file holds is asked for: a longer file shows without fstat
        assert calls == [("open", "w/c.2.0"), ("preadv", 0, CHUNK + CRC + 1)]
        assert CHUNK + CRC <= nbytes < CHUNK + CRC + SLACK

        part, calls, nbytes = reads.during(lambda: ck["w"][6:10])
        np.testing.assert_array_equal(part, state[6:10])
        assert calls == [("open", "w/c.1.0"), ("preadv", 0, CHUNK + CRC + 1),
                         ("open", "w/c.2.0"), ("preadv", 0, CHUNK + CRC + 1)]
        assert 2 * (CHUNK + CRC) <= nbytes < 2 * (CHUNK + CRC) + SLACK


def test_zarr_sharded_plain_path_reads_the_index_once_and_one_inner_chunk(
    tmp_path, weights, reads
):
    path = tmp_path / "w.zarr"
    ls.save({"w": weights}, path, chunk_bytes=CHUNK)  # 16 chunks: sharded
    slots = zarr_inner_chunks_per_shard(path)
    assert slots == 8
    shard = path / "w" / "c.1.0"  # rows 32-63
    index = zarr_shard_index(shard, slots)
    index_bytes, size = 16 * slots + CRC, shard.stat().st_size
    with ls.open(path) as ck:
        ck["w"][0:1, 0:1]  # the first read checks the array's zarr.json (shard 0)
        part, calls, nbytes = reads.during(lambda: ck["w"][41:43, 100:200:3])  # inner chunk 2
        np.testing.assert_array_equal(part, weights[41:43, 100:200:3])
        offset, stored = (int(v) for v in index[2])
        assert stored == CHUNK + CRC
        assert calls == [("open", "w/c.1.0"), ("pread", size - index_bytes, index_bytes),
                         ("preadv", offset, CHUNK + CRC)]
        assert CHUNK + CRC + index_bytes <= nbytes < CHUNK + CRC + index_bytes + SLACK

        part, calls, nbytes = reads.during(lambda: ck["w"][60])  # same shard: index kept
        np.testing.assert_array_equal(part, weights[60])
        offset = int(index[7][0])
        assert calls == [("open", "w/c.1.0"), ("preadv", offset, CHUNK + CRC)]
        assert CHUNK + CRC <= nbytes < CHUNK + CRC + SLACK


def test_zarr_compressed_plain_path_fetches_one_inner_chunk(tmp_path, noise, reads,
                                                             monkeypatch):
    """Compressed (Blosc) shards are read by lean_store's direct reader too: the shard index,
    then the one inner chunk the selection touches, decompressed by lean_store."""
    path = tmp_path / "w.zarr"
    ls.save({"w": noise}, path, chunk_bytes=CHUNK, compression="weights")
    slots = zarr_inner_chunks_per_shard(path)
    index = zarr_shard_index(path / "w" / "c.0.0", slots)
    assert int(index[:, 1].min()) > SLACK  # so that a second chunk would show
    fetched: list[tuple[str, object]] = []
    get = zarr.storage.LocalStore.get

    async def counting_get(self, key, prototype, byte_range=None):
        fetched.append((key, byte_range))
        return await get(self, key, prototype, byte_range)

    monkeypatch.setattr(zarr.storage.LocalStore, "get", counting_get)
    with ls.open(path) as ck:
        ck["w"][32:33, 0:1]  # warm up on the other shard
        fetched.clear()
        part, calls, nbytes = reads.during(lambda: ck["w"][10:12, 100:200:3])
    np.testing.assert_array_equal(part, noise[10:12, 100:200:3])
    assert fetched == []  # lean_store's direct reader, not zarr's store
    start, length = (int(v) for v in index[2])
    shard = path / "w" / "c.0.0"
    # the shard's index (at its end), then the one compressed inner chunk, at the index's offset
    assert calls == [("open", "w/c.0.0"), ("pread", shard.stat().st_size - 16 * slots - CRC,
                                           16 * slots + CRC), ("preadv", start, length)]
    stored = int(index[2][1])
    assert stored < CHUNK  # really compressed
    assert stored <= nbytes < stored + 16 * slots + CRC + SLACK
