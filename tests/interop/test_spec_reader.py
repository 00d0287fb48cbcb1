"""docs/FORMAT.md is complete: files lean_store writes are read bit-exactly by
``tests/spec_reader.py``, a reader written from the spec alone (it never imports lean_store).

lean_store only *makes* the sample files here; every check of what is on disk goes through the
spec reader, and its words are compared with the words that were saved.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import spec_reader as spec
from torch_optional import REASON, torch

import lean_store as ls
from lean_store.formats import binary, complex_of

ROOT = Path(__file__).resolve().parents[2]
F12 = binary(5, 6)  # binary_5_6_15_ieee: 12-bit words, N-bit packed in HDF5


def sample_state() -> tuple[dict, dict[str, tuple[str, np.ndarray]]]:
    """(what to save, name -> (format tag, expected container words))."""
    w = np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 7.5
    c = np.array([1 + 2j, -3.5j, np.nan], np.complex64)
    odd = np.array([0xABC, 0x123, 0x7FF, 0, 0x800], np.uint16)
    fn = np.array([0x7E, 0xFE, 0x7F, 0x01], np.uint8)
    e8 = np.array([127, 0, 254, 255], np.uint8)
    cb = np.array([[0x3FC0, 0xBF80], [0x7FC1, 0x0001]], np.uint16)  # complex(bfloat16)
    f4 = np.array([[1, 2, 3], [15, 8, 0]], np.uint8)
    i64 = np.array([-1, 2**62, -(2**63)], np.int64)
    state = {
        "w": w, "c": c, "s": np.array(2.5), "flag": np.array([True, False, True]),
        "i64": i64, "odd": ls.Encoded(odd, F12),
        "fn": ls.Encoded(fn, "float8_e4m3fn"), "e8": ls.Encoded(e8, "float8_e8m0fnu"),
        "cb": ls.Encoded(cb, complex_of("bfloat16")), "f4": ls.Encoded(f4, "float4_e2m1fn"),
        "a/b.c": np.arange(3, dtype=np.uint16),  # escaped node name a%2Fb.c
    }
    expected = {
        "w": ("float32", w.view(np.uint32)), "c": ("complex64", c.view(np.uint32).reshape(3, 2)),
        "s": ("float64", np.array(2.5).view(np.uint64)),
        "flag": ("bool", np.array([1, 0, 1], np.uint8)), "i64": ("int64", i64.view(np.uint64)),
        "odd": ("binary_5_6_15_ieee", odd), "fn": ("float8_e4m3fn", fn),
        "e8": ("float8_e8m0fnu", e8), "cb": ("complex(bfloat16)", cb),
        "f4": ("float4_e2m1fn", f4), "a/b.c": ("uint16", np.arange(3, dtype=np.uint16)),
    }
    if torch is not None:
        b = torch.tensor([1.5, -2.0, 3.25, float("inf")], dtype=torch.bfloat16)
        state["b"] = b
        expected["b"] = ("bfloat16", b.view(torch.int16).numpy().view(np.uint16))
    return state, expected


def test_the_spec_reader_does_not_use_the_library():
    source = (ROOT / "tests" / "spec_reader.py").read_text("utf-8")
    assert "import lean_store" not in source and "from lean_store" not in source


def check_all(got: dict[str, spec.Tensor], expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, (tag, words) in expected.items():
        t = got[name]
        assert t.fmt.tag == tag, name
        assert t.words.dtype == t.fmt.container, name
        assert t.words.shape == words.shape, name
        assert np.array_equal(t.words, words.astype(t.fmt.container)), name


@pytest.mark.parametrize("suffix", ["h5", "zarr"])
def test_single_file_checkpoints_read_bit_exactly(tmp_path, suffix):
    state, expected = sample_state()
    path = tmp_path / f"s.{suffix}"
    ls.save(state, path)
    read = spec.read_hdf5 if suffix == "h5" else spec.read_zarr
    check_all(read(path), expected)


def test_chunked_and_sharded_zarr_and_multi_chunk_hdf5(tmp_path):
    """Many chunks: chunk_crc32c per chunk (HDF5), sharding_indexed with its index (Zarr)."""
    big = np.arange(40000, dtype=np.float32).reshape(100, 400)
    words = np.arange(3000, dtype=np.uint16).reshape(1000, 3) & 0xFFF
    state = {"big": big, "odd": ls.Encoded(words, F12)}
    expected = {"big": ("float32", big.view(np.uint32)), "odd": ("binary_5_6_15_ieee", words)}
    ls.save(state, tmp_path / "m.h5", chunk_bytes=16000)
    ls.save(state, tmp_path / "m.zarr", chunk_bytes=16000)
    with h5py.File(tmp_path / "m.h5") as f:
        assert f["big"].chunks == (10, 400)  # 2.4: budget 4000, T(0) = 400, c = 10
    meta = json.loads((tmp_path / "m.zarr" / "big" / "zarr.json").read_text())
    assert meta["codecs"][0]["name"] == "sharding_indexed"
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [80, 400]  # 2.4: 8 × 10
    check_all(spec.read_hdf5(tmp_path / "m.h5"), expected)
    check_all(spec.read_zarr(tmp_path / "m.zarr"), expected)


def test_chunk_length_rule_of_section_2_4(tmp_path):
    """c = max(1, min(dk, budget div T(k))) at the first axis k with T(k) <= budget."""
    cases = {"a": (np.zeros((7, 300, 5), np.float64), (1, 25, 5)),  # budget 128: k=1, c=25
             "b": (np.zeros((3, 20), np.uint8), (3, 20)),  # all fits
             "s": (np.zeros(5000, np.int16), (512,))}
    ls.save({k: v for k, (v, _) in cases.items()}, tmp_path / "c.h5", chunk_bytes=1024)
    with h5py.File(tmp_path / "c.h5") as f:
        for name, (_, chunks) in cases.items():
            assert f[name].chunks == chunks, name


def test_hdf5_nbit_packs_most_significant_bit_first(tmp_path):
    """1.6: the stored chunk bytes of N-bit datasets, decoded by the spec's rule."""
    pairs = np.array([[0xABC, 0x123], [0x7FF, 0x001]], np.uint16)
    ls.save({"odd": ls.Encoded(np.array([0xABC, 0x123, 0x7FF], np.uint16), F12),
             "two": ls.Encoded(np.array([0xABC, 0x123], np.uint16), F12),
             "f4": ls.Encoded(np.array([1, 2, 3], np.uint8), "float4_e2m1fn"),
             "cz": ls.Encoded(pairs, complex_of(F12))}, tmp_path / "n.h5")
    with h5py.File(tmp_path / "n.h5") as f:
        raw = {n: f[n].id.read_direct_chunk((0,)) for n in f}
        assert all(mask == 0 for mask, _ in raw.values())
        assert raw["odd"][1] == bytes.fromhex("ABC1237FF0")
        assert raw["two"][1] == bytes.fromhex("ABC12300")  # floor(24/8) + 1 bytes
        assert raw["f4"][1] == bytes.fromhex("1230")
        assert raw["cz"][1] == bytes.fromhex("ABC1237FF00100")
    assert spec.nbit_unpack(raw["odd"][1], 3, [12]).ravel().tolist() == [0xABC, 0x123, 0x7FF]
    assert spec.nbit_unpack(raw["f4"][1], 3, [4]).ravel().tolist() == [1, 2, 3]
    assert np.array_equal(spec.nbit_unpack(raw["cz"][1], 2, [12, 12]), pairs)


def test_nbit_rule_on_an_edge_chunk_of_many_values(tmp_path):
    """An edge chunk is stored full size, padding included (1.6)."""
    words = (np.arange(1000 * 3, dtype=np.uint32) * 2654435761 % 4096).astype(np.uint16)
    ls.save({"x": ls.Encoded(words.reshape(1000, 3), F12)}, tmp_path / "e.h5", chunk_bytes=1024)
    with h5py.File(tmp_path / "e.h5") as f:
        ds = f["x"]
        rows = ds.chunks[0]
        last = (1000 // rows) * rows
        _, data = ds.id.read_direct_chunk((last, 0))
    assert len(data) == (rows * 3 * 12) // 8 + 1
    got = spec.nbit_unpack(data, rows * 3, [12]).reshape(rows, 3)
    assert np.array_equal(got[: 1000 - last], words.reshape(1000, 3)[last:])


def test_values_follow_the_bit_rules_of_section_1_2(tmp_path):
    state, expected = sample_state()
    ls.save(state, tmp_path / "v.h5")
    got = spec.read_hdf5(tmp_path / "v.h5")
    np.testing.assert_array_equal(  # NaN counts as equal to NaN here
        spec.decode_binary(got["odd"].words, got["odd"].fmt),
        F12.decode(np.array([0xABC, 0x123, 0x7FF, 0, 0x800], np.uint16)))
    fn = spec.decode_binary(got["fn"].words, got["fn"].fmt)
    assert fn[:2].tolist() == [448.0, -448.0] and np.isnan(fn[2]) and fn[3] == 2.0**-9
    if torch is not None:
        assert spec.decode_binary(got["b"].words, got["b"].fmt).tolist() == [
            1.5, -2.0, 3.25, float("inf")]


def test_the_reader_refuses_what_the_spec_calls_damage(tmp_path):
    state, _ = sample_state()
    ls.save(state, tmp_path / "d.h5")
    with h5py.File(tmp_path / "d.h5", "r+") as f:
        table = f["w"].attrs["chunk_crc32c"].copy()
        table[0] ^= 1
        f["w"].attrs["chunk_crc32c"] = table
    with pytest.raises(spec.SpecError, match="chunk_crc32c"):
        spec.read_hdf5(tmp_path / "d.h5")
    ls.save(state, tmp_path / "d.zarr")
    chunk = tmp_path / "d.zarr" / "w" / "c.0.0.0"
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(spec.SpecError, match="crc32c"):
        spec.read_zarr(tmp_path / "d.zarr")


def test_root_and_tensor_attributes_are_exactly_those_of_section_2(tmp_path):
    state, _ = sample_state()
    ls.save(state, tmp_path / "r.h5")
    with h5py.File(tmp_path / "r.h5") as f:
        root = f.attrs
        assert root["complete"].dtype == np.int8 and root["complete"] == 1
        assert len(root["save_id"]) == 32 and int(root["save_id"], 16) >= 0
        assert set(root) == {"lean_store", "format_version", "kind", "tensor_count", "layout",
                             "writer", "save_id", "manifest", "header_digests", "complete"}
        common = {"index", "name", "shape", "format", "width", "storage", "crc32c",
                  "chunk_crc32c"}
        binary_keys = {"exponent_bits", "fraction_bits", "bias", "encoding"}
        want = {"w": binary_keys, "odd": binary_keys, "fn": binary_keys, "e8": set(),
                "i64": set(), "flag": set(), "c": {"component"}, "cb": {"component"}}
        storage = {"w": "float", "odd": "float", "fn": "uint", "e8": "uint", "i64": "int",
                   "flag": "bool", "c": "compound", "cb": "compound", "a%2Fb.c": "int"}
        for name, extra in want.items():
            assert set(f[name].attrs) == common | extra, name
        for name, kind in storage.items():
            assert f[name].attrs["storage"].decode() == kind, name
        assert [f[n].id.get_create_plist().get_nfilters() for n in ("w", "odd")] == [0, 1]
    ls.save(state, tmp_path / "r.zarr")
    root = json.loads((tmp_path / "r.zarr" / "zarr.json").read_text())
    assert root["attributes"]["complete"] is True
    assert root["consolidated_metadata"]["kind"] == "inline"
    cb = json.loads((tmp_path / "r.zarr" / "cb" / "zarr.json").read_text())
    assert cb["dimension_names"] == ["cb.dim_0", "cb.word"]
    assert cb["attributes"]["storage"] == "raw" and cb["data_type"] == "uint16"
    s = json.loads((tmp_path / "r.zarr" / "s" / "zarr.json").read_text())
    assert s["dimension_names"] == ["s.scalar"] and s["attributes"]["storage"] == "native"


def test_header_digests_are_what_section_2_5_2_says(tmp_path):
    """Each row's ranges, chunk position and datatype message, and row 0's binding, read from
    the file's bytes as the spec describes them."""
    state, _ = sample_state()
    many = {f"layer{i}.{k}": np.full(shape, i, np.float32)
            for i in range(40) for k, shape in (("w", (6, 5)), ("b", (5,)))}
    for name, saved in (("s.h5", state), ("m.h5", many)):
        ls.save(saved, tmp_path / name)
        covered = spec.check_header_digests(tmp_path / name)
        with h5py.File(tmp_path / name) as f:  # one chunk, no filter (N-bit packing is one)
            plain = sum(1 for n in f if f[n].id.get_create_plist().get_nfilters() == 0
                        and f[n].id.get_num_chunks() == 1)
        assert plain and covered >= 0.8 * plain, name
    ls.save(many, tmp_path / "z.h5", compression="weights")  # compressed: no row
    assert spec.check_header_digests(tmp_path / "z.h5") == 0


def test_compressed_stores_use_the_documented_filters_and_codecs(tmp_path):
    x = np.arange(5000, dtype=np.float32)
    ls.save({"x": x}, tmp_path / "z.h5", compression="weights-gzip")
    with h5py.File(tmp_path / "z.h5") as f:
        plist = f["x"].id.get_create_plist()
        filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
        assert filters == [2, 1] and plist.get_filter(1)[2] == (1,)  # shuffle, deflate 1
    ls.save({"x": x}, tmp_path / "b.h5", compression="weights")
    with h5py.File(tmp_path / "b.h5") as f:
        plist = f["x"].id.get_create_plist()
        assert plist.get_nfilters() == 1  # Blosc: revision 2, format 2, typesize, chunk bytes,
        code, _flags, values = plist.get_filter(0)[:3]  # zstd level 1, byte shuffle
        assert (code, values) == (32001, (2, 2, 4, x.nbytes, 1, 1, 5))
    ls.save({"x": x}, tmp_path / "z.zarr", compression="weights")
    codecs = json.loads((tmp_path / "z.zarr" / "x" / "zarr.json").read_text())["codecs"]
    assert [c["name"] for c in codecs] == ["bytes", "blosc", "crc32c"]
    assert codecs[1]["configuration"] == {"typesize": 4, "cname": "zstd", "clevel": 1,
                                          "shuffle": "shuffle", "blocksize": 1048576}


@pytest.mark.skipif(torch is None, reason=REASON)
def test_training_checkpoint_json_is_the_documented_state_tree(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    extra = {"t": (1, 2), "big": 2**60, "x": float("inf"), 3: "k", "arr": np.arange(2)}
    ls.save_training(tmp_path / "t.h5", model=model, optimizer=opt, step=7, extra=extra)
    got = spec.read_hdf5(tmp_path / "t.h5")
    with h5py.File(tmp_path / "t.h5") as f:
        assert f.attrs["training_format_version"] == 1
        meta = json.loads(f.attrs["training"])
    assert meta["step"] == 7
    assert meta["model"] == {"class": "torch.nn.modules.linear.Linear", "tensors": 2}
    assert meta["optimizer"]["state"]["weight"] == {
        "step": "tensor", "exp_avg": "tensor", "exp_avg_sq": "tensor"}
    assert meta["optimizer"]["groups"][0]["hyper"]["betas"] == {"$tuple": [0.9, 0.999]}
    assert meta["extra"] == {"$dict": [
        ["t", {"$tuple": [1, 2]}], ["big", {"$int": str(2**60)}], ["x", {"$float": "inf"}],
        [3, "k"], ["arr", {"$array": "extra/4"}]]}
    assert meta["rng"]["torch_cpu"] == {"$tensor": "rng/torch_cpu"}
    assert meta["rng"]["numpy"]["$tuple"][1] == {"$array": "rng/numpy/1"}
    names = set(got)
    assert {"model/weight", "model/bias", "optimizer/state/weight/exp_avg",
            "optimizer/state/bias/step", "rng/torch_cpu", "rng/numpy/1", "extra/4"} <= names
    assert np.array_equal(got["model/weight"].words,
                          model.weight.detach().numpy().view(np.uint32))
    assert np.array_equal(got["extra/4"].words, np.arange(2).view(np.uint64))


# ------------------------------------------------------------------------------ sharded

SHARDED_CHILD = """
import sys, numpy as np, torch, torch.distributed as dist
import lean_store as ls
from lean_store.distributed import LocalShard
out, port = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
w = np.arange(20, dtype=np.float32).reshape(4, 5)
odd = np.array([0xABC, 0x123, 0x7FF], np.uint16)
st = {"w": LocalShard(torch.from_numpy(w), (4, 5), (0, 0)),
      "b": torch.tensor([1.5, 2.5], dtype=torch.bfloat16),
      "odd": ls.Encoded(odd, "binary_5_6_15_ieee")}
for name in ("sh.h5", "sh.zarr"):
    ls.save(st, out + "/" + name, process_group=dist.group.WORLD)
dist.destroy_process_group()
import os, sys; sys.stdout.flush(); os._exit(0)  # why: tests/gloo_world.py leave_world
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    if torch is None:
        pytest.skip(REASON)
    out = tmp_path_factory.mktemp("sharded")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SHARDED_CHILD, str(out), str(_free_port())],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _sharded_expected() -> dict:
    b = torch.tensor([1.5, 2.5], dtype=torch.bfloat16).view(torch.int16).numpy()
    return {"w": ("float32", np.arange(20, dtype=np.float32).reshape(4, 5).view(np.uint32)),
            "b": ("bfloat16", b.view(np.uint16)),
            "odd": ("binary_5_6_15_ieee", np.array([0xABC, 0x123, 0x7FF], np.uint16))}


def test_sharded_hdf5_directory_reads_through_master_and_shard_files(sharded):
    directory = sharded / "sh.h5"
    assert sorted(p.name for p in directory.iterdir()) == [
        "lean_store.h5", "shard-00000-of-00001.h5"]
    check_all(spec.read_hdf5(directory), _sharded_expected())
    with h5py.File(directory / "lean_store.h5") as f:
        assert f.attrs["complete"].dtype == np.int64  # 2.2 / 6.1: the master's is int64
        meta = json.loads(f.attrs["sharded"])
        assert meta["version"] == 1 and meta["world_size"] == 1 and len(meta["id"]) == 32
        assert "crc32c" not in f["w"].attrs and "chunk_crc32c" not in f["w"].attrs
        assert set(json.loads(f["w"].attrs["shards"])[0]) == {
            "offsets", "lengths", "rank", "crc32c", "unit"}
    with h5py.File(directory / "shard-00000-of-00001.h5") as g:
        assert g.attrs["complete"].dtype == np.int8
        plist = g["t000000-s00000"].id.get_create_plist()
        assert plist.get_filter(plist.get_nfilters() - 1)[0] == 3  # Fletcher-32 last


def test_sharded_zarr_reads_with_shard_records(sharded):
    check_all(spec.read_zarr(sharded / "sh.zarr"), _sharded_expected())
    meta = json.loads((sharded / "sh.zarr" / "w" / "zarr.json").read_text())
    assert "crc32c" not in meta["attributes"] and "shards" in meta["attributes"]


def test_shard_digest_is_taken_unit_by_unit():
    """6: with a unit that is not whole rows, the digest is not the C-order CRC."""
    words = np.arange(12, dtype=np.uint32).reshape(3, 4)
    by_units = spec.crc_by_units(words, (3, 2))
    assert by_units == spec.crc32c(np.concatenate([words[:, :2].ravel(), words[:, 2:].ravel()]))
    assert by_units != spec.crc32c(words)
    assert spec.crc_by_units(words, (1, 4)) == spec.crc32c(words)
