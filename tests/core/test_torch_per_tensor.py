"""Torch sources and loads without per-tensor torch work they do not need: host tensors are
sliced as numpy views, and the words read are exactly those of the tensor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import lean_store as ls

torch = pytest.importorskip("torch")
from lean_store.sources import tensor_source  # noqa: E402
from lean_store.sources.torch_source import new_tensor  # noqa: E402

TENSORS = {
    "matrix": lambda: torch.randn(3, 4),
    "transposed": lambda: torch.randn(4, 3).t(),
    "scalar": lambda: torch.tensor(3.5),
    "complex": lambda: torch.randn(2, 3, dtype=torch.complex64),
    "bfloat16": lambda: torch.randn(5, dtype=torch.bfloat16),
    "bool": lambda: torch.tensor([True, False, True]),
    "grad": lambda: torch.randn(3, 4, requires_grad=True),
    "strided": lambda: torch.randn(12)[::3],
    "int64": lambda: torch.arange(10),
}


def _words(t: torch.Tensor) -> np.ndarray:
    """The raw words of ``t`` computed independently: bytes reinterpreted as unsigned ints."""
    t = t.detach().reshape(1) if t.dim() == 0 else t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    raw = t.contiguous().numpy() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy()
    return np.ascontiguousarray(raw).view(f"u{raw.dtype.itemsize}")


@pytest.mark.parametrize("kind", list(TENSORS))
def test_host_torch_source_reads_the_exact_words(kind: str) -> None:
    torch.manual_seed(0)
    t = TENSORS[kind]()
    entry, source = next(tensor_source({"x": t}).tensors())
    whole = _words(t)
    shape = t.shape or (1,)
    regions = [tuple(slice(0, d) for d in shape), tuple(slice(0, max(1, d // 2)) for d in shape)]
    for region in regions:
        got = source.read(region)
        assert got.flags.c_contiguous
        assert got.dtype == entry.format.storage_dtype
        np.testing.assert_array_equal(got, whole[region])


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64, torch.complex32,
                                   torch.bfloat16, torch.int16])
def test_new_tensor_rebuilds_the_dtype_and_shape(dtype: torch.dtype) -> None:
    t = (torch.randn(2, 3, dtype=torch.complex64) if dtype.is_complex else
         torch.randn(2, 3) * 100).to(dtype)
    entry, source = next(tensor_source({"x": t}).tensors())
    bits = source.read((slice(0, 2), slice(0, 3))).copy()
    for device in (None, "cpu", torch.device("cpu")):
        out = new_tensor(bits, entry.format, (2, 3), device)
        assert out.dtype == dtype and tuple(out.shape) == (2, 3) and out.device.type == "cpu"
        assert torch.equal(torch.view_as_real(out) if dtype.is_complex else out,
                           torch.view_as_real(t) if dtype.is_complex else t)


def test_torch_state_round_trips_bit_exact(tmp_path: Path, suffix: str) -> None:
    torch.manual_seed(1)
    state = {k: f() for k, f in TENSORS.items()}
    path = tmp_path / f"ck{suffix}"
    ls.save(state, path, progress=False)
    back = ls.load_state(path, like=state)
    for name, t in state.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        np.testing.assert_array_equal(_words(back[name]), _words(t))
