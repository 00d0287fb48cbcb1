"""torch's ``float4_e2m1fn_x2`` (two OCP MX FP4 values a byte, ``val0`` in bits 0-3) is stored
as the ``float4_e2m1fn`` values it holds, shape ``(..., 2n)``, and loads back bit for bit into
such tensors (in place, ``like=``, strided targets). It was refused ("torch dtype
torch.float4_e2m1fn_x2 has no lean_store format"); safetensors 0.8 writes such tensors (as
``F4``, the same shape and order) but cannot load them."""

from __future__ import annotations

import numpy as np
import pytest
from torch_optional import require_torch

torch = require_torch()

import lean_store as ls  # noqa: E402
from lean_store.sources import packed_fp4  # noqa: E402

X2 = getattr(torch, "float4_e2m1fn_x2", None)
pytestmark = pytest.mark.skipif(X2 is None, reason="this torch has no float4_e2m1fn_x2")


def _packed(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(X2)


def _bytes(t):
    return t.view(torch.uint8).reshape(-1).numpy().tobytes()


def _state():
    return {"w": _packed((5, 6)), "v": _packed((7,), 1), "s": torch.tensor(0x7A).to(
        torch.uint8).view(X2), "e": torch.empty(0, 3, dtype=X2), "f": torch.ones(3)}


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_packed_fp4_round_trips_bit_for_bit(tmp_path, suffix) -> None:
    state = _state()
    path = tmp_path / f"p{suffix}"
    ls.save(state, path)
    with ls.open(path) as ck:
        assert ck.layout["w"].shape == (5, 12) and ck.layout["w"].format.tag == "float4_e2m1fn"
        assert ck.layout["s"].shape == (2,) and ck.layout["e"].shape == (0, 6)
    values = ls.load_state(path)["w"]  # the FP4 values, low nibble first
    raw = state["w"].view(torch.uint8).numpy()
    assert np.array_equal(values.view(np.uint8)[:, 0::2], raw & 0xF)
    assert np.array_equal(values.view(np.uint8)[:, 1::2], raw >> 4)
    assert float(values[0, 0]) == float(np.array(raw[0, 0] & 0xF, np.uint8).view(
        values.dtype))
    like = ls.load_state(path, like=state)
    for name, want in state.items():
        assert like[name].dtype == want.dtype and like[name].shape == want.shape
        assert _bytes(like[name]) == _bytes(want), name
    for verify in (True, False):
        target = {n: torch.zeros(v.shape, dtype=torch.uint8).view(X2) if v.dtype == X2
                  else torch.zeros_like(v) for n, v in state.items()}
        ls.load(target, path, verify=verify)
        assert all(_bytes(target[n]) == _bytes(v) for n, v in state.items())
    base = torch.zeros(5, 12, dtype=torch.uint8).view(X2)  # a strided view as the target
    with pytest.warns(UserWarning):
        ls.load({"w": base[:, ::2]}, path, strict=False)
    assert _bytes(base[:, ::2].contiguous()) == _bytes(state["w"])
    assert not base.view(torch.uint8)[:, 1::2].any()


def test_regions_that_split_a_byte_keep_its_other_value() -> None:
    t = _packed((3, 5), 2)
    before = t.view(torch.uint8).clone().numpy()
    words = np.array([[0x3, 0xC, 0x1]] * 3, np.uint8)
    packed_fp4.write_words(t, (slice(0, 3), slice(3, 6)), words)  # values 3..5: bytes 1..2
    after = t.view(torch.uint8).numpy()
    assert np.array_equal(after[:, 0], before[:, 0]) and np.array_equal(after[:, 3:], before[:, 3:])
    assert np.array_equal(after[:, 1] & 0xF, before[:, 1] & 0xF)  # value 2 kept
    assert np.array_equal(after[:, 1] >> 4, words[:, 0])
    assert np.array_equal(after[:, 2], words[:, 1] | (words[:, 2] << 4))
    with pytest.raises(ls.IntegrityError, match="wider than 4 bits"):
        packed_fp4.write_words(t, (slice(0, 1), slice(0, 1)), np.array([[0x10]], np.uint8))


def test_a_sharded_save_refuses_packed_fp4_shards() -> None:
    from lean_store.sources.torch_source import value_format

    with pytest.raises(ls.FormatError, match="single-process saves only"):
        value_format("w", _packed((2, 2)))


def test_safetensors_f4_files_convert_both_ways_byte_for_byte(tmp_path) -> None:
    """safetensors writes a packed FP4 tensor as ``F4`` (shape (..., 2n), the same order) but
    its own loader cannot read it back; lean_store reads it, and writes it again unchanged."""
    from safetensors.torch import save_file

    from lean_store.interop.convert import convert

    state = {"w": _packed((5, 6)), "b": torch.randn(3)}
    save_file(state, str(tmp_path / "f4.safetensors"))
    convert(tmp_path / "f4.safetensors", tmp_path / "f4.h5")
    got = ls.load_state(tmp_path / "f4.h5", like=state)
    assert _bytes(got["w"]) == _bytes(state["w"]) and got["w"].dtype == X2
    convert(tmp_path / "f4.h5", tmp_path / "back.safetensors")
    back = (tmp_path / "back.safetensors").read_bytes()
    assert back == (tmp_path / "f4.safetensors").read_bytes()
    fp4 = ls.formats.get("float4_e2m1fn").numpy_dtype
    ls.save({"odd": np.array([0.5, 1.0, 6.0]).astype(fp4)}, tmp_path / "odd.h5")
    with pytest.raises(ls.FormatError, match="odd|even count"):
        convert(tmp_path / "odd.h5", tmp_path / "odd.safetensors")
    assert not (tmp_path / "odd.safetensors").exists()
