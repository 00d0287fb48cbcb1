"""HDF5 per-chunk CRC-32C table (``chunk_crc32c``): written right, checked on every chunk read
(partial reads included), hostile tables rejected, fletcher32 still available as an option."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import google_crc32c
import h5py
import numpy as np
import pytest
from h5py import h5z

import lean_store as ls
from lean_store.integrity import crc32c_combine
from lean_store.stores.hdf5.crc_table import CHUNK_CRC_ATTR

ROWS, COLS = 50, 100  # float32, chunk_bytes=4096 -> chunks of 10 rows
A = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)


def _save(tmp_path: Path, **kwargs) -> Path:
    path = tmp_path / "ck.h5"
    ls.save({"w": A, "e": np.arange(35, dtype=np.int16)}, path, chunk_bytes=4096, **kwargs)
    return path


def _without_manifest(path: Path) -> Path:
    """As lean_store wrote files before the root manifest: each dataset's attributes are
    then what the reader goes by (with a manifest, see tests/stores/test_hdf5_manifest.py)."""
    with h5py.File(path, "r+") as f:
        del f.attrs["manifest"]
    return path


def _chunk_offsets(path: Path, name: str) -> list[int]:
    with h5py.File(path, "r") as f:
        ds = f[name]
        return [ds.id.get_chunk_info(i).byte_offset for i in range(ds.id.get_num_chunks())]


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _read(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


@pytest.mark.parametrize("kwargs", [{}, {"compression": "gzip"},
                                    {"checksum": "fletcher32+crc32c"}])
def test_table_holds_the_crc_of_each_clipped_chunk_in_grid_order(tmp_path, kwargs) -> None:
    path = _save(tmp_path, **kwargs)
    with h5py.File(path, "r") as f:
        table = f["w"].attrs[CHUNK_CRC_ATTR]
        edge = f["e"].attrs[CHUNK_CRC_ATTR]
        chunks = f["e"].chunks
        digest = int(f["w"].attrs["crc32c"])
    assert table.dtype == np.uint32 and table.shape == (5,)
    assert [int(v) for v in table] == [google_crc32c.value(A[i : i + 10].tobytes())
                                       for i in range(0, ROWS, 10)]
    e = np.arange(35, dtype=np.int16)
    step = chunks[0]
    assert [int(v) for v in edge] == [google_crc32c.value(e[i : i + step].tobytes())
                                      for i in range(0, 35, step)]
    assert digest == google_crc32c.value(A.tobytes())  # derived from the table by crc32c_combine
    np.testing.assert_array_equal(ls.load_state(path)["w"], A)
    assert ls.verify(path).ok


def test_default_has_no_fletcher32_and_the_option_adds_it(tmp_path) -> None:
    default = _save(tmp_path)
    with h5py.File(default, "r") as f:
        assert f["w"].id.get_create_plist().get_nfilters() == 0
    other = tmp_path / "f32.h5"
    ls.save({"w": A}, other, chunk_bytes=4096, checksum="fletcher32+crc32c")
    with h5py.File(other, "r") as f:
        plist = f["w"].id.get_create_plist()
        codes = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
        assert codes == [h5z.FILTER_FLETCHER32]
        np.testing.assert_array_equal(f["w"][...], A)  # h5py verifies it natively
    dump = subprocess.run(["h5dump", "-d", "/w", "-p", str(other)], capture_output=True,
                          text=True, timeout=60)
    assert dump.returncode == 0, dump.stderr
    assert "FLETCHER32" in dump.stdout and "4999" in dump.stdout
    # a flipped byte: HDF5 itself (h5py, h5dump) refuses the chunk
    offset = _chunk_offsets(other, "w")[2]
    _patch(other, offset + 8, bytes([_read(other, offset + 8, 1)[0] ^ 0x10]))
    with h5py.File(other, "r") as f, pytest.raises(OSError):
        f["w"][20:30]
    with ls.open(other) as ck, pytest.raises(ls.IntegrityError):
        ck["w"][21:22, 5:9]


def test_unknown_checksum_choices_are_rejected(tmp_path) -> None:
    with pytest.raises(ls.CheckpointError, match="checksum"):
        ls.save({"w": A}, tmp_path / "x.h5", checksum="md5")
    with pytest.raises(ls.CheckpointError, match="Zarr"):
        ls.save({"w": A}, tmp_path / "x.zarr", checksum="fletcher32+crc32c")
    assert not os.listdir(tmp_path)


def test_corrupt_chunk_is_caught_by_a_partial_read_of_it(tmp_path) -> None:
    path = _save(tmp_path)
    offset = _chunk_offsets(path, "w")[2]  # rows 20..29
    _patch(path, offset + 404, bytes([_read(path, offset + 404, 1)[0] ^ 0x01]))
    with ls.open(path) as ck:
        np.testing.assert_array_equal(ck["w"][0:20:3, 7], A[0:20:3, 7])  # chunks 0, 1
        np.testing.assert_array_equal(ck["w"][30:], A[30:])
        for key in [(25, 3), (slice(21, 22), slice(5, 9)), (slice(None, None, 7), 0)]:
            with pytest.raises(ls.IntegrityError, match=r"chunk \(2, 0\).*chunk_crc32c"):
                ck["w"][key]
    report = ls.verify(path)
    assert [(p.tensor, p.chunk) for p in report.problems] == [("w", (2, 0))]
    target = {"w": np.zeros_like(A), "e": np.zeros(35, np.int16)}
    with pytest.raises(ls.IntegrityError):
        ls.load(target, path)
    assert not target["w"].any() and not target["e"].any()  # the target is unchanged


def test_swapped_chunks_are_caught_by_a_partial_read(tmp_path) -> None:
    path = _save(tmp_path)
    offsets = _chunk_offsets(path, "w")
    n = 10 * COLS * 4
    one, two = _read(path, offsets[1], n), _read(path, offsets[3], n)
    _patch(path, offsets[1], two)
    _patch(path, offsets[3], one)
    with h5py.File(path, "r") as f:  # both chunks are well-formed: HDF5 sees nothing wrong
        np.testing.assert_array_equal(f["w"][10:20], A[30:40])
    with ls.open(path) as ck:
        np.testing.assert_array_equal(ck["w"][0:10], A[0:10])
        with pytest.raises(ls.IntegrityError, match="misplaced"):
            ck["w"][12:14, 50]
        with pytest.raises(ls.IntegrityError, match="misplaced"):
            ck["w"][35]
    assert sorted(p.chunk for p in ls.verify(path).problems) == [(1, 0), (3, 0)]


@pytest.mark.parametrize(
    "value, match",
    [
        (np.zeros(4, np.uint32), "4 values for 5 chunks"),
        (np.zeros(6, np.uint32), "6 values for 5 chunks"),
        (np.zeros((5, 1), np.uint32), "unsupported shape|5 chunks"),
        (np.zeros(5, np.float32), "not an integer array"),
        (np.int64(7), "not an integer array"),
        (np.array(b"abcde"), "not an integer array"),
        (np.array([-1, 0, 0, 0, 0], np.int64), "outside uint32"),
        (np.array([1 << 40, 0, 0, 0, 0], np.int64), "outside uint32"),
    ],
)
def test_hostile_chunk_crc_attribute_is_rejected(tmp_path, value, match) -> None:
    path = _without_manifest(_save(tmp_path))
    with h5py.File(path, "r+") as f:
        del f["w"].attrs[CHUNK_CRC_ATTR]
        f["w"].attrs[CHUNK_CRC_ATTR] = value
    with pytest.raises(ls.IntegrityError, match=match):
        ls.open(path)
    with pytest.raises(ls.IntegrityError):
        ls.load_state(path)
    report = ls.verify(path)
    assert not report.ok and match.split("|")[0].split()[0] in str(report)


def test_a_wrong_table_entry_is_a_bad_chunk(tmp_path) -> None:
    path = _without_manifest(_save(tmp_path))
    with h5py.File(path, "r+") as f:
        table = f["w"].attrs[CHUNK_CRC_ATTR].copy()
        table[4] ^= 1
        f["w"].attrs[CHUNK_CRC_ATTR] = table
    with ls.open(path) as ck:
        np.testing.assert_array_equal(ck["w"][:40], A[:40])
        with pytest.raises(ls.IntegrityError, match=r"chunk \(4, 0\)"):
            ck["w"][45]
    assert [p.chunk for p in ls.verify(path).problems] == [(4, 0)]


def test_files_without_a_table_still_verify_by_fletcher32(tmp_path) -> None:
    """Files written before the table existed (fletcher32 only) read as before."""
    path = _without_manifest(_save(tmp_path, checksum="fletcher32+crc32c"))
    with h5py.File(path, "r+") as f:
        for name in ("w", "e"):
            del f[name].attrs[CHUNK_CRC_ATTR]
    np.testing.assert_array_equal(ls.load_state(path)["w"], A)
    assert ls.verify(path).ok
    offset = _chunk_offsets(path, "w")[1]
    _patch(path, offset + 8, bytes([_read(path, offset + 8, 1)[0] ^ 0x10]))
    with ls.open(path) as ck, pytest.raises(ls.IntegrityError):
        ck["w"][15]


def test_crc32c_combine_matches_concatenation() -> None:
    rng = np.random.default_rng(1)
    for la, lb in [(0, 0), (0, 9), (9, 0), (1, 1), (1000, 4096), (3, 123457)]:
        a = rng.integers(0, 256, la, dtype=np.uint8).tobytes()
        b = rng.integers(0, 256, lb, dtype=np.uint8).tobytes()
        crc = google_crc32c.value
        assert crc32c_combine(crc(a), crc(b), lb) == crc(a + b)
