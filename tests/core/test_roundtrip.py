"""Round trips through both backends, compared by bits."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import spec_reader as spec
import zarr
from helpers import ALL_FORMATS, assert_same_state, h5_text, raw, sample_bits, value_of
from torch_optional import needs_torch, torch

import lean_store as ls
from lean_store.naming import legacy_node_name, node_name


def test_every_format_every_code_point(tmp_path, suffix):
    rng = np.random.default_rng(0)
    state = {
        f"t{i}.{fmt.tag}": value_of(sample_bits(fmt, rng), fmt) for i, fmt in enumerate(ALL_FORMATS)
    }
    path = tmp_path / f"all{suffix}"
    layout = ls.save(state, path)
    assert [e.format for e in layout] == ALL_FORMATS
    back = ls.load_state(path)
    assert_same_state(state, back)
    with ls.open(path) as ck:
        for name, value in state.items():
            assert raw(ck[name].read()) == raw(value)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.tag)
def test_scalars_empty_and_multidim(tmp_path, suffix, fmt):
    rng = np.random.default_rng(1)
    bits = sample_bits(fmt, rng)
    pair = fmt.words_per_value == 2
    scalar = bits[0]
    empty = bits[:0].reshape((0, 3) + ((2,) if pair else ()))
    count = (len(bits) // 6) * 6
    cube = bits[:count].reshape((count // 6, 2, 3) + ((2,) if pair else ()))
    state = {
        "scalar": value_of(scalar, fmt),
        "empty": value_of(empty, fmt),
        "cube": value_of(cube, fmt),
    }
    path = tmp_path / f"s{suffix}"
    ls.save(state, path, chunk_bytes=1024)
    back = ls.load_state(path)
    assert_same_state(state, back)
    assert np.shape(back["scalar"]) == () or getattr(back["scalar"], "shape", None) == ()


def test_non_contiguous_and_big_endian_arrays(tmp_path, suffix):
    base = np.arange(600, dtype=np.float64).reshape(20, 30)
    state = {
        "strided": base[::3, 1::2],
        "transposed": base.T,
        "big_endian": np.arange(10, dtype=">f4"),
        "complex_strided": (base + 1j * base).astype(np.complex64)[:, ::4],
    }
    path = tmp_path / f"n{suffix}"
    ls.save(state, path, chunk_bytes=1024)
    back = ls.load_state(path)
    for name, value in state.items():
        np.testing.assert_array_equal(back[name], value)
        assert back[name].dtype == value.dtype.newbyteorder("=")


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 2)
    )


@needs_torch
def test_torch_module_with_buffers(tmp_path, suffix):
    torch.manual_seed(0)
    model = _model()
    model.register_buffer("scratch", torch.ones(4), persistent=False)
    model(torch.randn(8, 5))  # updates BatchNorm running stats
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
        model[0].weight[0, 1] = -0.0
        model[0].weight[0, 2] = 1e-45  # subnormal
    path = tmp_path / f"m{suffix}"
    layout = ls.save(model, path)
    assert "scratch" not in layout and "1.num_batches_tracked" in layout
    fresh = _model()
    result = ls.load(fresh, path)
    assert result.loaded == layout.names()
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert raw(a) == raw(b), name
    with ls.open(path) as ck:
        assert ck.kind == "module"


@needs_torch
def test_torch_dtypes_and_load_state_like(tmp_path, suffix):
    torch.manual_seed(0)
    state = {
        "bf16": torch.randn(5, 3, dtype=torch.bfloat16),
        "f8": torch.randn(9).to(torch.float8_e4m3fn),
        "f8fnuz": torch.randn(9).to(torch.float8_e5m2fnuz),
        "c32": torch.randn(3, dtype=torch.complex32),
        "c128": torch.randn(3, dtype=torch.complex128),
        "i64": torch.arange(4),
        "flag": torch.tensor([True, False]),
        "t": torch.randn(4, 6).t(),
    }
    path = tmp_path / f"t{suffix}"
    ls.save(state, path)
    with ls.open(path) as ck:
        assert ck["c32"].format.tag == "complex(float16)"
        assert ck["f8"].format.tag == "float8_e4m3fn"
    back = ls.load_state(path, like=state)
    for name, value in state.items():
        assert isinstance(back[name], torch.Tensor)
        assert raw(back[name]) == raw(value), name
    plain = ls.load_state(path)
    assert isinstance(plain["c32"], ls.Encoded)  # numpy has no complex-of-float16
    assert plain["bf16"].dtype.name == "bfloat16"


def test_load_into_numpy_and_encoded_targets(tmp_path, suffix):
    fmt = ls.formats.binary(5, 6)
    src = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "e": ls.Encoded.from_values([1.0, -2.0, 0.5], fmt),
    }
    path = tmp_path / f"x{suffix}"
    ls.save(src, path)
    target = {"a": np.zeros((2, 3), np.float32), "e": ls.Encoded(np.zeros(3, np.uint16), fmt)}
    ls.load(target, path)
    assert_same_state(src, target)


def test_compression_and_overwrite(tmp_path, suffix):
    state = {"w": np.zeros((256, 256), np.float32)}
    path = tmp_path / f"c{suffix}"
    ls.save(state, path, compression="gzip")
    with ls.open(path) as ck:
        np.testing.assert_array_equal(np.asarray(ck["w"]), state["w"])
    state2 = {"w": np.ones((3,), np.float64)}
    ls.save(state2, path)  # overwrite in place, atomically
    assert_same_state(state2, ls.load_state(path))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_backend_from_suffix_and_errors(tmp_path):
    with pytest.raises(ls.CheckpointError, match="suffix"):
        ls.save({"a": np.zeros(2)}, tmp_path / "x.bin")
    ls.save({"a": np.zeros(2)}, tmp_path / "x.bin", backend="zarr")
    with ls.open(tmp_path / "x.bin") as ck:
        assert ck.backend == "zarr"
    with pytest.raises(ls.CheckpointError, match="nothing to save"):
        ls.save({}, tmp_path / "empty.h5")
    with pytest.raises(ls.CheckpointError, match="unknown backend"):
        ls.save({"a": np.zeros(2)}, tmp_path / "x.h5", backend="parquet")
    assert not (tmp_path / "empty.h5").exists()


@needs_torch
def test_explicit_cast_only(tmp_path, suffix):
    path = tmp_path / f"cast{suffix}"
    ls.save({"w": torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)}, path)
    target = {"w": torch.zeros(3)}
    with pytest.raises(ls.LayoutError, match="format"):
        ls.load(target, path)
    assert torch.equal(target["w"], torch.zeros(3))
    ls.load(target, path, cast={"w": "float32"})
    assert target["w"].tolist() == [1.5, -2.25, 3.0]
    with pytest.raises(ls.LayoutError, match="cast"):
        ls.load(target, path, cast={"w": "float16"})
    out = ls.load_state(path, cast={"w": "float64"})
    assert out["w"].dtype == np.float64
    for whole in ("float32", 5):  # not a mapping: a CheckpointError, not AttributeError
        with pytest.raises(ls.CheckpointError, match="cast must map tensor names"):
            ls.load(target, path, cast=whole)
        with pytest.raises(ls.CheckpointError, match="cast must map tensor names"):
            ls.load_state(path, cast=whole)


# Names of the stores' own files, and names next to them (FORMAT.md 2.1), with the node names
# the spec gives them: the tensors are arrays at the root under these names, whatever the case.
STORE_FILE_NAMES = {  # zarr.json in three cases: one per save (they collide with each other)
    "zarr.json": "%7Aarr.json", "ZARR.JSON": "%5AARR.JSON", "Zarr.Json": "%5Aarr.Json",
}
NEIGHBOUR_NAMES = {
    ".zattrs": "%2Ezattrs", ".zgroup": "%2Ezgroup", ".zarray": "%2Ezarray",
    ".zmetadata": "%2Ezmetadata", "__c": "%5F_c",
    "c": "c",  # an array's chunk prefix, but the root group has no chunks
    "a/zarr.json": "a%2Fzarr.json", "zarr.json/c": "zarr.json%2Fc", "zarr.json.1": "zarr.json.1",
    # lean_store's own root attributes and sharded files: other namespaces, nothing to escape
    "manifest": "manifest", "lean_store.h5": "lean_store.h5", "t000000-s00000": "t000000-s00000",
}


def _h5_name(ds: h5py.Dataset) -> str:
    value = ds.attrs["name"]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _state_of(names: list[str]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    state = {n: rng.standard_normal((3, 5)).astype(np.float32) for n in names}
    for value in state.values():  # bits floats lose elsewhere: a NaN payload and -0.0
        value.view(np.uint32)[0, 0] = 0x7FC0_1234
        value[0, 1] = -0.0
    return state


@pytest.mark.parametrize("reserved", list(STORE_FILE_NAMES))
def test_names_of_the_stores_own_files(tmp_path, suffix, reserved):
    """A tensor named zarr.json (any case) was an array directory over the Zarr group's own
    metadata file (EISDIR); it is stored as %7Aarr.json on both backends, and read back by
    name by lean_store, zarr-python / h5py and the spec reader."""
    nodes = {reserved: STORE_FILE_NAMES[reserved], **NEIGHBOUR_NAMES}
    state = _state_of(list(nodes))
    path = tmp_path / f"r{suffix}"
    layout = ls.save(state, path)
    assert layout.names() == list(nodes)
    assert_same_state(state, ls.load_state(path))
    with ls.open(path) as ck:
        assert list(ck) == list(nodes)
        for name, value in state.items():
            assert ck.stored(name).node == nodes[name] == node_name(name), name
            assert raw(ck[name].read()) == raw(value), name
    assert ls.verify(path).ok
    if suffix == ".zarr":
        assert sorted(p.name for p in path.iterdir()) == sorted([*nodes.values(), "zarr.json"])
        group = zarr.open_group(str(path), mode="r", zarr_format=3)
        assert sorted(group.array_keys()) == sorted(nodes.values())
        for name, node in nodes.items():
            assert group[node].attrs["name"] == name
            assert group[node][...].tobytes() == state[name].tobytes(), name
        read = spec.read_zarr(path)
    else:
        with h5py.File(path, "r") as f:
            assert sorted(f) == sorted(nodes.values())
            for name, node in nodes.items():
                assert _h5_name(f[node]) == name
                assert f[node][...].tobytes() == state[name].tobytes(), name
        read = spec.read_hdf5(path)
    assert sorted(read) == sorted(nodes)
    for name, value in state.items():
        assert read[name].words.tobytes() == value.tobytes(), name


@pytest.mark.parametrize("reserved", list(STORE_FILE_NAMES))
def test_zarr_json_names_from_before_the_rule_still_load(tmp_path, suffix, reserved, monkeypatch):
    """A checkpoint written before zarr.json was escaped holds the tensor under the unescaped
    node name (HDF5: any case; Zarr: any case but the exact one, on a case-sensitive file
    system): it still loads by its name attribute, and the spec reader finds it too."""
    store = "lean_store.stores." + ("zarr" if suffix == ".zarr" else "hdf5") + ".store.node_name"
    monkeypatch.setattr(store, lambda name: legacy_node_name(name) or node_name(name))
    state = _state_of([reserved, "other"])
    path = tmp_path / f"old{suffix}"
    if suffix == ".zarr" and reserved == "zarr.json":
        # the one name no such store can hold: that save failed before the rule, typed,
        # leaving nothing behind
        with pytest.raises(ls.CheckpointError):
            ls.save(state, path)
        assert not path.exists()
        return
    ls.save(state, path)  # as the writers before the rule wrote it
    monkeypatch.undo()
    if suffix == ".zarr":
        found = sorted(p.name for p in path.iterdir())
        read = spec.read_zarr(path)
    else:
        with h5py.File(path, "r") as f:
            found = sorted(f)
        read = spec.read_hdf5(path)
    assert reserved in found and STORE_FILE_NAMES[reserved] not in found
    _loads_as_saved(path, state, reserved, read)


def test_hdf5_dataset_renamed_to_zarr_json_loads(tmp_path):
    """The same, built with h5py alone: the dataset renamed to zarr.json after a save, and the
    root manifest's record (2.5.1) renamed with it, as a writer before the rule had them."""
    state = _state_of(["zarr.json", "other"])
    path = tmp_path / "renamed.h5"
    ls.save(state, path)
    with h5py.File(path, "r+") as f:
        f.move("%7Aarr.json", "zarr.json")
        manifest = json.loads(f.attrs["manifest"].decode("utf-8"))
        for record in manifest["tensors"]:
            if record["node"] == "%7Aarr.json":
                record["node"] = "zarr.json"
        f.attrs["manifest"] = h5_text(json.dumps(manifest, separators=(",", ":")))
    with h5py.File(path, "r") as f:
        assert sorted(f) == ["other", "zarr.json"]
    _loads_as_saved(path, state, "zarr.json", spec.read_hdf5(path))


def _loads_as_saved(path: Path, state: dict, name: str, read: dict) -> None:
    assert_same_state(state, ls.load_state(path))
    with ls.open(path) as ck:
        assert list(ck) == list(state)
        assert ck.stored(name).node == legacy_node_name(name) == name
        assert raw(ck[name].read()) == raw(state[name])
    assert ls.verify(path).ok
    assert read[name].words.tobytes() == state[name].tobytes()
