"""The fast ``compression="weights"`` readers and writers: HDF5's Blosc filter (id 32001),
written and read by lean_store itself (no plugin), read by h5py + hdf5plugin and by h5dump
with ``HDF5_PLUGIN_PATH``; the plugin-free ``"weights-gzip"``; Zarr's Blosc chunks read straight
from the files. Exact bits, CRCs checked, partial reads touching only their chunks, hostile
parameters and frames refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import ALL_FORMATS, BACKENDS, SUFFIX, assert_same_state, raw, sample_bits, value_of

import lean_store as ls
import lean_store.stores.zarr.direct_read as zdr
from lean_store.errors import CheckpointError, IntegrityError, UnsafeFileError
from lean_store.stores.hdf5 import blosc as hdf5_blosc

REPO = Path(__file__).resolve().parents[2]


def _weights(rows: int = 64, cols: int = 256, seed: int = 1) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.02).astype(np.float32)


def _all_formats() -> dict:
    rng = np.random.default_rng(0)
    return {f"t{i}.{fmt.tag}": value_of(sample_bits(fmt, rng), fmt)
            for i, fmt in enumerate(ALL_FORMATS)}


def _filters(path: Path, name: str) -> list[tuple]:
    with h5py.File(path, "r") as f:
        dcpl = f[name].id.get_create_plist()
        return [dcpl.get_filter(i)[:3] for i in range(dcpl.get_nfilters())]


def _child(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (hdf5plugin registers its filters process-wide)."""
    full = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=full)


@pytest.mark.parametrize("checksum", ["crc32c", "fletcher32+crc32c"])
@pytest.mark.parametrize("compression", ["weights", "weights-gzip"])
def test_hdf5_every_format_exact(tmp_path, compression, checksum):
    state = _all_formats()
    path = tmp_path / "all.h5"
    ls.save(state, path, compression=compression, chunk_bytes=4096, checksum=checksum)
    assert_same_state(state, ls.load_state(path))
    with ls.open(path) as ck:
        for name, value in state.items():
            assert raw(ck[name].read()) == raw(value)
    assert ls.verify(path).ok


def test_hdf5_blosc_reads_without_any_plugin(tmp_path):
    """In a process where hdf5plugin cannot be imported and HDF5's plugin path is an empty
    folder, lean_store still loads and verifies a Blosc file: it decodes the chunks itself."""
    path = tmp_path / "w.h5"
    w = _weights(102, 256)
    ls.save({"w": w}, path, compression="weights", chunk_bytes=4096)
    np.save(tmp_path / "w.npy", w)
    (tmp_path / "no-plugins").mkdir()
    code = f"""
import sys
sys.modules["hdf5plugin"] = None  # any import of it fails
import numpy as np, lean_store as ls
got = ls.load_state({str(path)!r})["w"]
assert np.array_equal(got, np.load({str(tmp_path / "w.npy")!r}))
assert ls.verify({str(path)!r}).ok
with ls.open({str(path)!r}) as ck:
    assert np.array_equal(ck["w"][3:90:7, 5], np.load({str(tmp_path / "w.npy")!r})[3:90:7, 5])
print("ok")
"""
    out = _child(code, HDF5_PLUGIN_PATH=str(tmp_path / "no-plugins"))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_hdf5_weights_is_the_blosc_filter_with_hdf5_blosc_parameters(tmp_path):
    path = tmp_path / "w.h5"
    bf16 = ls.formats.get("bfloat16")
    state = {"w": _weights(), "b": value_of(sample_bits(bf16, np.random.default_rng(2)), bf16)}
    ls.save(state, path, compression="weights", chunk_bytes=4096)
    (code, flags, values), = _filters(path, "w")
    assert code == 32001 and flags & h5py.h5z.FLAG_OPTIONAL
    assert values == (2, 2, 4, 4096, 1, 1, 5)  # revision, format, typesize, chunk, zstd 1
    assert _filters(path, "b")[0][2][2] == 2  # shuffled by the bf16 word width
    with h5py.File(path, "r") as f:  # the payload is one Blosc 1 frame, numcodecs' bytes
        from numcodecs import blosc

        mask, payload = f["w"].id.read_direct_chunk((0, 0))
        assert mask == 0 and payload[0] == 2
        assert np.frombuffer(blosc.decompress(payload), np.float32).tobytes() == \
            state["w"][:4].tobytes()


def test_hdf5_nbit_formats_keep_builtin_filters_under_weights(tmp_path):
    twelve = ls.formats.binary(5, 6)  # N-bit packed by HDF5: its pipeline, then deflate
    state = {"p": value_of(sample_bits(twelve, np.random.default_rng(0)), twelve)}
    path = tmp_path / "p.h5"
    ls.save(state, path, compression="weights")
    assert [f[0] for f in _filters(path, "p")] == [
        h5py.h5z.FILTER_NBIT, h5py.h5z.FILTER_SHUFFLE, h5py.h5z.FILTER_DEFLATE]
    assert_same_state(state, ls.load_state(path))


def _plugin_path() -> str:
    """hdf5plugin's folder of HDF5 filter plugins, found without importing it here (importing
    it registers its filters with HDF5 in this process)."""
    import importlib.util

    spec = importlib.util.find_spec("hdf5plugin")
    assert spec is not None and spec.origin, "hdf5plugin is a test dependency (pyproject.toml)"
    return str(Path(spec.origin).parent / "plugins")


def test_h5py_with_hdf5plugin_reads_our_blosc_file(tmp_path):
    _plugin_path()
    path = tmp_path / "w.h5"
    w = _weights(102, 256)  # 26 chunks of 4 rows, the last an edge chunk of 2
    f16 = _weights(30, 50, seed=3).astype(np.float16)
    ls.save({"w": w, "h": f16}, path, compression="weights", chunk_bytes=4096,
            checksum="fletcher32+crc32c")
    np.save(tmp_path / "w.npy", w)
    np.save(tmp_path / "h.npy", f16)
    code = f"""
import hdf5plugin, h5py, numpy as np
with h5py.File({str(path)!r}, "r") as f:
    assert f["w"].fletcher32
    assert np.array_equal(f["w"][...].view(np.float32), np.load({str(tmp_path / "w.npy")!r}))
    assert np.array_equal(f["h"][...].view(np.float16), np.load({str(tmp_path / "h.npy")!r}))
    assert np.array_equal(f["w"][5:99:3, 7], np.load({str(tmp_path / "w.npy")!r})[5:99:3, 7])
print("ok")
"""
    out = _child(code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_h5dump_reads_blosc_with_plugin_path_and_gzip_without(tmp_path):
    plugins = _plugin_path()
    h5dump = shutil.which("h5dump")
    assert h5dump, "h5dump is required: ./dev test installs Debian's hdf5-tools"
    values = np.array([1.5, -2.25, 1e-3], dtype=np.float32)
    for compression, env in (("weights", {"HDF5_PLUGIN_PATH": plugins}),
                             ("weights-gzip", {})):
        path = tmp_path / f"{compression}.h5"
        ls.save({"f32": values}, path, compression=compression)
        out = subprocess.run([h5dump, "-A", "0", "-d", "f32", str(path)], capture_output=True,
                             text=True, timeout=60, env={**os.environ, **env})
        assert out.returncode == 0, (compression, out.stderr)
        assert "1.5, -2.25, 0.001" in " ".join(out.stdout.split("DATA {", 1)[1].split())


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupt_compressed_chunk_raises(tmp_path, backend):
    """One flipped bit in a stored compressed chunk: IntegrityError on load, a bad verify."""
    path = tmp_path / f"w{SUFFIX[backend]}"
    w = _weights(512, 256)
    ls.save({"w": w}, path, compression="weights", chunk_bytes=32768)
    if backend == "hdf5":
        with h5py.File(path, "r") as f:
            info = f["w"].id.get_chunk_info_by_coord((64, 0))  # the 3rd chunk
        at = info.byte_offset + info.size // 2
        target = path
    else:
        target = max((p for p in path.rglob("*") if p.is_file() and p.name != "zarr.json"),
                     key=lambda p: p.stat().st_size)
        at = 100  # inside the first Blosc frame (after its header)
    data = bytearray(target.read_bytes())
    data[at] ^= 0x10
    target.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        ls.load_state(path)
    assert not ls.verify(path).ok


def _spy_hdf5_chunks(monkeypatch) -> list[tuple[int, ...]]:
    from lean_store.stores.hdf5 import store as hdf5

    seen: list[tuple[int, ...]] = []
    real = hdf5_blosc.read_blosc_chunk

    def spy(node, dsid, start, *rest):
        seen.append(tuple(start))
        return real(node, dsid, start, *rest)

    monkeypatch.setattr(hdf5_blosc, "read_blosc_chunk", spy)
    monkeypatch.setattr(hdf5, "_h5read", lambda *a: pytest.fail("HDF5's pipeline was used"))
    return seen


def test_hdf5_blosc_partial_read_touches_only_its_chunks(tmp_path, monkeypatch):
    path = tmp_path / "w.h5"
    w = _weights(64, 256)  # 1 KiB rows; 4 KiB chunks = 4 rows, 16 chunks
    ls.save({"w": w}, path, compression="weights", chunk_bytes=4096)
    seen = _spy_hdf5_chunks(monkeypatch)
    with ls.open(path) as ck:
        np.testing.assert_array_equal(ck["w"][5:7, 10:20], w[5:7, 10:20])
        assert seen == [(4, 0)]
        seen.clear()
        np.testing.assert_array_equal(ck["w"][3:13:4, 1], w[3:13:4, 1])
        assert seen == [(0, 0), (4, 0), (8, 0)]


def test_hdf5_blosc_region_of_a_chunk_clipped_on_two_axes(tmp_path):
    """Chunks on a 2-D grid (not lean_store's row blocks; h5py + hdf5plugin writes such
    files), clipped at both edges: decoded whole, then cut to the region."""
    from numcodecs import blosc

    w = _weights(21, 19)
    path = tmp_path / "g.h5"
    with h5py.File(path, "w") as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((8, 8))
        hdf5_blosc.set_blosc(dcpl, 4, 8 * 8 * 4)
        dsid = h5py.h5d.create(f.id, b"w", h5py.h5t.IEEE_F32LE,
                               h5py.h5s.create_simple(w.shape), dcpl=dcpl)
        for r in range(0, 21, 8):
            for c in range(0, 19, 8):
                chunk = np.zeros((8, 8), np.float32)
                part = w[r:r + 8, c:c + 8]
                chunk[: part.shape[0], : part.shape[1]] = part
                dsid.write_direct_chunk((r, c), blosc.compress(chunk, b"zstd", 1, 1, 0), 0)
    with h5py.File(path, "r") as f:
        out = np.empty((5, 3), np.float32)
        assert hdf5_blosc.read_blosc_region("w", f["w"].id, (16, 16), (5, 3), (8, 8), 4,
                                            False, out)
        np.testing.assert_array_equal(out, w[16:21, 16:19])
        whole = np.empty((8, 8), np.float32)
        hdf5_blosc.read_blosc_region("w", f["w"].id, (8, 0), (8, 8), (8, 8), 4, False, whole)
        np.testing.assert_array_equal(whole, w[8:16, 0:8])


def test_zarr_weights_read_through_the_direct_reader(tmp_path, monkeypatch):
    path = tmp_path / "w.zarr"
    w = _weights(64, 256)
    ls.save({"w": w, "s": _weights(3, 5)}, path, compression="weights", chunk_bytes=4096)
    seen: list[tuple[int, ...]] = []
    real = zdr.DirectReader._read_chunk
    monkeypatch.setattr(zdr.DirectReader, "_read_chunk",
                        lambda self, coords, dst: (seen.append(coords), real(self, coords, dst)))
    got = ls.load_state(path)
    np.testing.assert_array_equal(got["w"], w)
    assert len(seen) == 17  # 16 chunks of "w" (2 shards), 1 of "s": none through zarr
    with ls.open(path) as ck:
        seen.clear()
        np.testing.assert_array_equal(ck["w"][5:7, 10:20], w[5:7, 10:20])
        assert seen == [(1, 0)]


def _first_frame(path: Path) -> tuple[Path, int, int]:
    """(shard file, offset, nbytes) of the first chunk of array ``w`` (sharded)."""
    shard = next(p for p in (path / "w").rglob("*") if p.is_file() and p.name != "zarr.json")
    data = shard.read_bytes()
    slots = 8
    index = np.frombuffer(data[-(16 * slots + 4):-4], "<u8").reshape(slots, 2)
    return shard, int(index[0, 0]), int(index[0, 1])


def _rewrite_frame(path: Path, edit) -> None:
    """Change the first stored chunk's Blosc frame with ``edit`` and recompute its CRC-32C,
    so only the frame checks can catch it."""
    import google_crc32c

    shard, offset, nbytes = _first_frame(path)
    data = bytearray(shard.read_bytes())
    frame = bytearray(data[offset: offset + nbytes - 4])
    edit(frame)
    data[offset: offset + nbytes - 4] = frame
    data[offset + nbytes - 4: offset + nbytes] = google_crc32c.value(bytes(frame)).to_bytes(
        4, "little")
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("what", ["size", "format", "cbytes"])
def test_zarr_frame_header_lies_are_refused_before_decompressing(tmp_path, what):
    path = tmp_path / "w.zarr"
    w = _weights(64, 256)
    ls.save({"w": w}, path, compression="weights", chunk_bytes=4096)

    def edit(frame: bytearray) -> None:
        if what == "size":  # claims a huge chunk: never allocated, never decompressed
            frame[4:8] = (2**31).to_bytes(4, "little")
        elif what == "format":
            frame[0] = 9
        else:
            frame[12:16] = (len(frame) + 100).to_bytes(4, "little")

    _rewrite_frame(path, edit)
    with pytest.raises(IntegrityError, match="Blosc header"):
        ls.load_state(path)


def test_zarr_shard_index_with_oversized_entry_is_refused(tmp_path):
    path = tmp_path / "w.zarr"
    ls.save({"w": _weights(64, 256)}, path, compression="weights", chunk_bytes=4096)
    import google_crc32c

    shard, _offset, _nbytes = _first_frame(path)
    data = bytearray(shard.read_bytes())
    n = 16 * 8 + 4
    index = np.frombuffer(bytes(data[-n:-4]), "<u8").reshape(8, 2).copy()
    index[0, 1] = 4096 + 16 + 4 + 1  # more than a frame of a 4 KiB chunk can take
    data[-n:-4] = index.tobytes()
    data[-4:] = google_crc32c.value(bytes(data[-n:-4])).to_bytes(4, "little")
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="bad shard index entry"):
        ls.load_state(path)


@pytest.mark.parametrize("values, problem", [
    ((2, 2, 4, 4096, 1, 1, 9), "compressor 9"),
    ((2, 2, 4, 4096, 12, 1, 5), "level 12"),
])
def test_hdf5_blosc_parameters_are_checked_on_open(tmp_path, monkeypatch, values, problem):
    """A file whose Blosc parameters lean_store does not accept is refused before any data
    is read (hdf5-blosc, when loaded, fills in only the first four parameters itself)."""
    path = tmp_path / "w.h5"
    monkeypatch.setattr(hdf5_blosc, "blosc_parameters", lambda itemsize, nbytes: values)
    ls.save({"w": _weights(64, 256)}, path, compression="weights", chunk_bytes=4096)
    monkeypatch.undo()
    with pytest.raises(UnsafeFileError, match=problem):
        ls.load_state(path)
    assert not ls.verify(path).ok


class _Pipeline:
    """A dataset creation property list as check_blosc_filter reads it."""

    def __init__(self, values: tuple[int, ...], chunks=(4, 256), layout=h5py.h5d.CHUNKED):
        self._values, self._chunks, self._layout = values, chunks, layout

    def get_nfilters(self) -> int:
        return 1

    def get_filter(self, i: int) -> tuple:
        return (32001, 1, self._values, b"")

    def get_chunk(self) -> tuple[int, ...]:
        return self._chunks

    def get_layout(self) -> int:
        return self._layout


@pytest.mark.parametrize("values, problem", [
    ((2, 3, 4, 4096, 1, 1, 5), "Blosc format 3"),
    ((3, 2, 4, 4096, 1, 1, 5), "filter revision 3"),
    ((2, 2, 0, 4096, 1, 1, 5), "type size 0"),
    ((2, 2, 4), "3 parameters"),
    ((2, 2, 4, 4096, 1, 1, 5, 0), "8 parameters"),
    ((2, 2, 4, 4095, 1, 1, 5), "whole number of bytes"),
    ((2, 2, 4, 4096, 1, 3, 5), "shuffle 3"),
])
def test_hdf5_blosc_parameters_validation(values, problem):
    with pytest.raises(UnsafeFileError, match=problem):
        hdf5_blosc.check_blosc_filter("w", _Pipeline(values), h5py.h5d.CHUNKED)
    hdf5_blosc.check_blosc_filter("w", _Pipeline((2, 2, 4, 4096, 1, 1, 5)), h5py.h5d.CHUNKED)
    hdf5_blosc.check_blosc_filter("w", _Pipeline((2, 2, 4, 4096)), h5py.h5d.CHUNKED)
    with pytest.raises(UnsafeFileError, match="without chunks"):
        hdf5_blosc.check_blosc_filter("w", _Pipeline((2, 2, 4, 4096)), h5py.h5d.CONTIGUOUS)


def test_hdf5_blosc_dataset_is_never_read_through_hdf5s_pipeline(tmp_path):
    """A strided read of a Blosc dataset without its CRC table (not a lean_store file any
    more) is refused rather than handed to HDF5, which would look for a filter plugin."""
    path = tmp_path / "w.h5"
    ls.save({"w": _weights(64, 256)}, path, compression="weights", chunk_bytes=4096)
    from lean_store.stores.hdf5.store import HDF5Reader

    with h5py.File(path, "a") as f:
        del f["w"].attrs["chunk_crc32c"]
        del f.attrs["manifest"]
    reader = HDF5Reader(path)
    try:
        from lean_store.stores.base import Selection

        fmt = ls.formats.get("float32")
        with pytest.raises(UnsafeFileError, match="plugin"):
            reader.read("w", Selection((1, 0), (3, 4), (2, 3)), fmt)
    finally:
        reader.close()


def test_zarr_rejects_weights_gzip_clearly(tmp_path):
    with pytest.raises(CheckpointError, match="weights-gzip"):
        ls.save({"w": _weights()}, tmp_path / "w.zarr", compression="weights-gzip")
    assert list(tmp_path.iterdir()) == []


def test_inspect_names_blosc_and_gzip(tmp_path, capsys):
    from lean_store.cli import main

    for compression, name in (("weights", "blosc"), ("weights-gzip", "gzip")):
        path = tmp_path / f"{compression}.h5"
        ls.save({"w": _weights(256, 256)}, path, compression=compression)
        assert main(["inspect", str(path), "--json"]) == 0
        row = json.loads(capsys.readouterr().out)["tensors"][0]
        assert name in row["compression"] and row["ratio"] < 0.95


@pytest.mark.parametrize("checksum", ["crc32c", "fletcher32+crc32c"])
def test_hdf5_blosc_without_the_pread_path(tmp_path, monkeypatch, checksum):
    """Where HDF5's descriptor cannot be used (another driver, a user block), Blosc chunks
    come through H5Dread_chunk instead: the same bits."""
    from lean_store.stores.hdf5 import store as hdf5_store

    state = _all_formats()
    path = tmp_path / "all.h5"
    ls.save(state, path, compression="weights", chunk_bytes=4096, checksum=checksum)
    calls: list[int] = []
    real = hdf5_blosc._stored_chunk

    def spy(node, dsid, start, nbytes, fletcher32, fd, size):
        calls.append(fd is None)
        return real(node, dsid, start, nbytes, fletcher32, fd, size)

    monkeypatch.setattr(hdf5_blosc, "_stored_chunk", spy)
    assert_same_state(state, ls.load_state(path))
    assert calls and not any(calls)  # pread through HDF5's descriptor
    calls.clear()
    monkeypatch.setattr(hdf5_store, "_h5_descriptor", lambda f: (None, 0))
    assert_same_state(state, ls.load_state(path))
    assert calls and all(calls)  # H5Dread_chunk
