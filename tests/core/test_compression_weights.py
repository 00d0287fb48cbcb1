"""``compression="weights"``: byte shuffle by the word width + zstd in Blosc (Zarr's blosc
codec, HDF5's Blosc filter 32001), and the plugin-free HDF5 ``compression="weights-gzip"``: HDF5's
own shuffle + deflate (tests/core/test_compression_fast.py covers the Blosc files in HDF5). Exact
bits for every format, readable by plain h5py/zarr, per-chunk CRCs still checked, partial reads
still touch only the chunks they need."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import zarr
from helpers import ALL_FORMATS, BACKENDS, assert_same_state, raw, sample_bits, value_of
from zarr.codecs import BloscCodec

import lean_store as ls
from lean_store.errors import CheckpointError, IntegrityError


def _weights(rows: int = 64, cols: int = 256) -> np.ndarray:
    """Trained-looking float32 weights: small, normal-ish values (compressible exponents)."""
    return (np.random.default_rng(1).standard_normal((rows, cols)) * 0.02).astype(np.float32)


def test_every_format_exact_with_weights_compression(tmp_path, suffix):
    rng = np.random.default_rng(0)
    state = {
        f"t{i}.{fmt.tag}": value_of(sample_bits(fmt, rng), fmt) for i, fmt in enumerate(ALL_FORMATS)
    }
    path = tmp_path / f"all{suffix}"
    # small chunks: several chunks (and zarr shards) per tensor, edge chunks included
    ls.save(state, path, compression="weights", chunk_bytes=4096)
    assert_same_state(state, ls.load_state(path))
    with ls.open(path) as ck:
        for name, value in state.items():
            assert raw(ck[name].read()) == raw(value)
    assert ls.verify(path).ok


def test_hdf5_filters_are_builtin_in_pipeline_order(tmp_path):
    nbit = ls.formats.binary(5, 6)  # 12-bit, stored N-bit packed
    rng = np.random.default_rng(0)
    state = {"w": _weights(), "p": value_of(sample_bits(nbit, rng), nbit)}
    path = tmp_path / "w.h5"
    ls.save(state, path, compression="weights-gzip", checksum="fletcher32+crc32c")
    with h5py.File(path, "r") as f:
        w = f["w"]
        assert (w.shuffle, w.compression, w.compression_opts, w.fletcher32) == (
            True, "gzip", 1, True)
        np.testing.assert_array_equal(w[...].view(np.float32), state["w"])  # plain h5py
        plist = f["p"].id.get_create_plist()
        order = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
        assert order == [h5py.h5z.FILTER_NBIT, h5py.h5z.FILTER_SHUFFLE,
                         h5py.h5z.FILTER_DEFLATE, h5py.h5z.FILTER_FLETCHER32]
    assert_same_state(state, ls.load_state(path))


def _name(value) -> str:
    return str(getattr(value, "value", value))


def test_zarr_codec_is_blosc_shuffle_and_stock_zarr_reads_it(tmp_path):
    path = tmp_path / "w.zarr"
    state = {"w": _weights(), "b": value_of(sample_bits(ls.formats.get("bfloat16"),
                                                        np.random.default_rng(0)),
                                            ls.formats.get("bfloat16"))}
    ls.save(state, path, compression="weights", chunk_bytes=4096)
    group = zarr.open_group(path, mode="r")
    codecs = _inner_codecs(group["w"])
    blosc = [c for c in codecs if isinstance(c, BloscCodec)]
    assert len(blosc) == 1 and _name(blosc[0].cname) == "zstd"  # an enum, a str in zarr >= 3.4
    assert _name(blosc[0].shuffle) == "shuffle" and blosc[0].typesize == 4
    assert type(codecs[-1]).__name__.endswith("Crc32cCodec")  # crc32c over the stored bytes
    bf = _inner_codecs(group["b"])
    assert next(c for c in bf if isinstance(c, BloscCodec)).typesize == 2  # grouped by width
    np.testing.assert_array_equal(group["w"][...], state["w"])


def _inner_codecs(array) -> list:
    codecs = list(array.metadata.codecs)
    if type(codecs[0]).__name__ == "ShardingCodec":
        codecs = list(codecs[0].codecs)
    return codecs


def test_weights_compression_shrinks_float_weights(tmp_path, suffix):
    w = _weights(256, 256)
    plain, packed = tmp_path / f"a{suffix}", tmp_path / f"b{suffix}"
    ls.save({"w": w}, plain)
    ls.save({"w": w}, packed, compression="weights")

    def size(p):
        return p.stat().st_size if p.is_file() else sum(
            f.stat().st_size for f in p.rglob("*") if f.is_file())

    assert size(packed) < 0.9 * size(plain)


def _corrupt_compressed(path):
    """Flip one bit in the middle of the largest data file (HDF5: of the file's data area)."""
    files = [path] if path.is_file() else [
        p for p in path.rglob("*") if p.is_file() and p.name != "zarr.json"]
    target = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    at = len(data) // 2
    data[at] ^= 0x04
    target.write_bytes(bytes(data))


def test_corrupt_compressed_chunk_is_caught(tmp_path, suffix):
    path = tmp_path / f"w{suffix}"
    w = _weights(512, 256)  # 512 KiB: the middle of the file is chunk data
    ls.save({"w": w}, path, compression="weights", chunk_bytes=32768)
    _corrupt_compressed(path)
    report = ls.verify(path)
    assert not report.ok
    with pytest.raises(IntegrityError):
        ls.load_state(path)


def test_partial_read_touches_only_needed_chunks(tmp_path, backend, suffix, monkeypatch):
    path = tmp_path / f"w{suffix}"
    w = _weights(64, 256)  # 1 KiB rows; 4 KiB chunks = 4 rows, 16 chunks
    ls.save({"w": w}, path, compression="weights" if backend == "zarr" else "weights-gzip",
            chunk_bytes=4096)
    if backend == "hdf5":
        from lean_store.stores.hdf5 import store as hdf5

        calls = []
        real = hdf5._h5read
        monkeypatch.setattr(hdf5, "_h5read", lambda *a: (calls.append(a[3].start), real(*a)))
        with ls.open(path) as ck:
            np.testing.assert_array_equal(ck["w"][5:7, 10:20], w[5:7, 10:20])
        assert calls == [(4, 0)]  # one whole chunk, decompressed through HDF5's pipeline
    else:
        from counting import CountingStore

        store = CountingStore(path, read_only=True)
        with ls.open(store, backend="zarr") as ck:
            CountingStore.fetched = []
            np.testing.assert_array_equal(ck["w"][5:7, 10:20], w[5:7, 10:20])
            data = [(k, n) for k, n in CountingStore.fetched if not k.endswith("zarr.json")]
        assert len({k for k, _ in data}) == 1  # one shard file
        assert sum(n for _, n in data) < 4096 + 1024  # one compressed chunk + the shard index


def test_unknown_compression_is_a_clear_error(tmp_path, suffix):
    with pytest.raises(CheckpointError, match="weights"):
        ls.save({"w": _weights()}, tmp_path / f"w{suffix}", compression="weight")
    assert list(tmp_path.iterdir()) == []


def test_checkpointer_passes_weights_compression(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(16, 8)
    for backend in BACKENDS:
        ck = ls.Checkpointer(tmp_path / backend, backend=backend)
        ck.save(1, model=model, compression="weights")
        fresh = torch.nn.Linear(16, 8)
        ck.restore(model=fresh)
        assert torch.equal(fresh.weight, model.weight)


def test_inspect_shows_stored_size_and_ratio(tmp_path, backend, suffix, capsys):
    import json

    from lean_store.cli import main

    w = _weights(256, 256)
    path = tmp_path / f"w{suffix}"
    ls.save({"w": w, "n": np.arange(10, dtype=np.int64)}, path, compression="weights")
    assert main(["inspect", str(path), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["tensors"]}
    row = rows["w"]
    assert row["bytes"] == w.nbytes
    assert row["ratio"] == round(row["bytes_on_disk"] / w.nbytes, 4) and row["ratio"] < 0.9
    assert "blosc" in row["compression"]
    assert main(["inspect", str(path)]) == 0
    table = capsys.readouterr().out
    assert "ratio" in table and f"{row['ratio']:.3f}" in table


@pytest.mark.parametrize("checksum", ["crc32c", "fletcher32+crc32c"])
def test_threaded_deflate_chunks_are_what_hdf5_filters_make(tmp_path, checksum, monkeypatch):
    """lean_store shuffles and deflates HDF5 chunks itself (on a thread pool): the stored
    chunks must decode, through HDF5's own pipeline and by hand, to HDF5's shuffled bytes."""
    import zlib

    from lean_store.stores.hdf5 import deflate as hdf5_deflate

    submitted = []
    real = hdf5_deflate.DeflateChunks.submit
    monkeypatch.setattr(hdf5_deflate.DeflateChunks, "submit",
                        lambda self, *a: (submitted.append(a[0]), real(self, *a)))
    w = _weights(102, 256)  # 4 KiB chunks of 4 rows, the last one an edge chunk of 2 rows
    ours, theirs = tmp_path / "ours.h5", tmp_path / "theirs.h5"
    ls.save({"w": w}, ours, compression="weights-gzip", chunk_bytes=4096, checksum=checksum)
    assert len(submitted) == 26  # every chunk went through lean_store's threaded deflate
    with h5py.File(theirs, "w") as f:
        f.create_dataset("w", data=w, chunks=(4, 256), shuffle=True, compression="gzip",
                         compression_opts=1, fletcher32=checksum != "crc32c")
    with h5py.File(ours, "r") as a, h5py.File(theirs, "r") as b:
        np.testing.assert_array_equal(a["w"][...].view(np.float32), w)  # HDF5's pipeline
        for row in range(0, 102, 4):
            mask_a, raw_a = a["w"].id.read_direct_chunk((row, 0))
            mask_b, raw_b = b["w"].id.read_direct_chunk((row, 0))
            assert mask_a == mask_b == 0
            if checksum != "crc32c":
                raw_a, raw_b = raw_a[:-4], raw_b[:-4]
            valid = min(4, 102 - row) * 256 * 4  # edge chunks: the padding is unspecified

            def unshuffled(raw):
                return np.frombuffer(zlib.decompress(raw), np.uint8).reshape(4, -1).T.reshape(-1)

            assert unshuffled(raw_a)[:valid].tobytes() == unshuffled(raw_b)[:valid].tobytes()
            assert unshuffled(raw_a)[:valid].tobytes() == w[row: row + 4].tobytes()


def test_h5dump_reads_weights_gzip_compression(tmp_path):
    import shutil
    import subprocess

    h5dump = shutil.which("h5dump")
    assert h5dump, "h5dump is required: ./dev test installs Debian's hdf5-tools"
    path = tmp_path / "w.h5"
    twelve = ls.formats.binary(5, 6)  # N-bit packed, then shuffled and deflated
    ls.save({"f32": np.array([1.5, -2.25, 1e-3], dtype=np.float32),
             "b12": ls.Encoded.from_values([0.75, -6.5, 1024.0], twelve)},
            path, compression="weights-gzip")
    for name, text in (("f32", "1.5, -2.25, 0.001"), ("b12", "0.75, -6.5, 1024")):
        out = subprocess.run([h5dump, "-A", "0", "-d", name, str(path)], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert text in " ".join(out.stdout.split("DATA {", 1)[1].split()), out.stdout


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_deflate_planes_is_one_valid_zlib_stream(itemsize):
    """Compressible planes deflated, random ones stored; zlib (as HDF5) inflates it all and
    checks the Adler-32."""
    import zlib

    from lean_store.stores.hdf5.deflate import deflate_planes, shuffle

    rng = np.random.default_rng(itemsize)
    n = 70_000  # planes larger than the sample
    words = rng.integers(0, 256, size=(n, itemsize), dtype=np.uint8)
    words[:, -1] = rng.choice([0x3C, 0x3D, 0xBC, 0xBD], size=n)  # a low-entropy "exponent"
    shuffled = shuffle(words.reshape(-1), itemsize)
    packed = deflate_planes(shuffled, itemsize, 1)
    assert zlib.decompress(packed) == shuffled.tobytes()
    if itemsize > 1:  # random planes stored (+ a few bytes per block), the exponent one shrunk
        assert len(packed) < shuffled.size - 0.5 * n
    assert zlib.decompress(deflate_planes(np.zeros(0, np.uint8), itemsize, 1)) == b""
