"""Round trips through both backends, compared by bits."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import ALL_FORMATS, assert_same_state, raw, sample_bits, value_of
from torch_optional import needs_torch, torch

import lean_store as ls


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
