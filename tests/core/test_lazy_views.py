"""Tensors whose memory holds other values than they show: torch's lazy conjugate and negative
views (``x.conj()``, ``x.mH`` of a complex ``x``, ``torch._neg_view``). A save stores the values
the tensor shows; a load refuses to write into such a view (it would have to store other words
than the checkpoint holds). Nested tensors and subclasses that handle torch's operations themselves
(wrappers of other tensors) are refused by name, like sparse ones."""

from __future__ import annotations

import numpy as np
import pytest

import lean_store as ls
from lean_store import UnsupportedValueError

torch = pytest.importorskip("torch")

SUFFIXES = [".h5", ".zarr"]


def _views() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    c = torch.randn(4, 3, dtype=torch.complex64, generator=gen)
    return {
        "conj": c.conj(),
        "adjoint": c.mH,  # a transposed conjugate view
        "neg": torch._neg_view(torch.randn(5, generator=gen)),
        "neg_conj": torch._neg_view(c.conj()),
        "conj128": torch.randn(3, dtype=torch.complex128, generator=gen).conj(),
    }


def _values(t: torch.Tensor) -> torch.Tensor:
    return t.resolve_conj().resolve_neg().contiguous()


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    want = _values(want)
    if want.is_complex():
        return torch.equal(torch.view_as_real(got), torch.view_as_real(want))
    return torch.equal(got, want)


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("blocking", [True, False])
def test_a_lazy_view_is_saved_with_the_values_it_shows(tmp_path, suffix, blocking) -> None:
    views = _views()
    assert all(v.is_conj() or v.is_neg() for v in views.values())
    path = tmp_path / f"views{suffix}"
    handle = ls.save(views, path, blocking=blocking)
    if not blocking:
        handle.wait()
    out = {k: torch.empty_like(_values(v)) for k, v in views.items()}
    ls.load(out, path)
    for name, view in views.items():
        assert _same(out[name], view), name
    got = ls.load_state(path)
    for name, view in views.items():
        assert np.array_equal(np.asarray(got[name]), _values(view).numpy()), name
    assert ls.verify(path).ok


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_module_buffer_that_is_a_lazy_view_is_saved_with_its_values(tmp_path, suffix) -> None:
    module = torch.nn.Module()
    base = torch.randn(2, 2, dtype=torch.complex64)
    module.register_buffer("phase", base.conj())
    path = tmp_path / f"m{suffix}"
    ls.save(module, path)
    other = torch.nn.Module()
    other.register_buffer("phase", torch.zeros(2, 2, dtype=torch.complex64))
    ls.load(other, path)
    assert _same(other.phase, base.conj())


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_loading_into_a_lazy_view_is_refused_before_anything_is_written(tmp_path,
                                                                         suffix) -> None:
    path = tmp_path / f"c{suffix}"
    saved = torch.randn(3, dtype=torch.complex64)
    ls.save({"a": torch.ones(2), "c": saved}, path)
    memory = torch.zeros(3, dtype=torch.complex64)
    first = torch.zeros(2)
    with pytest.raises(UnsupportedValueError) as info:
        ls.load({"a": first, "c": memory.conj()}, path)
    message = str(info.value)
    assert "'c'" in message and "conjugate view" in message and "resolve_conj" in message
    assert torch.equal(first, torch.zeros(2))  # nothing installed
    assert torch.equal(memory, torch.zeros(3, dtype=torch.complex64))
    negative = torch._neg_view(torch.zeros(2))
    with pytest.raises(UnsupportedValueError, match="negative view"):
        ls.load({"a": negative, "c": torch.zeros(3, dtype=torch.complex64)}, path)


def test_a_nested_tensor_is_refused_by_name(tmp_path) -> None:
    import warnings

    with warnings.catch_warnings():  # "nested tensors are in prototype stage"
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(UnsupportedValueError) as info:
        ls.save({"w": torch.ones(2), "n": nested}, tmp_path / "n.h5")
    assert "'n'" in str(info.value) and "unbind()" in str(info.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_subclass_that_dispatches_itself_is_refused_by_name(tmp_path, suffix) -> None:
    """A wrapper subclass (torchao's quantized and float8 tensors, NF4 are such) has no
    values of its own memory: refused on save and as a load target, nothing written."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    wrapped = two_tensor.TwoTensor(torch.ones(3), torch.zeros(3))
    with pytest.raises(UnsupportedValueError) as info:
        ls.save({"w": torch.ones(2), "q": wrapped}, tmp_path / f"q{suffix}")
    assert "'q'" in str(info.value) and "TwoTensor" in str(info.value)
    assert list(tmp_path.iterdir()) == []
    path = tmp_path / f"ok{suffix}"
    ls.save({"q": torch.full((3,), 2.0)}, path)
    with pytest.raises(UnsupportedValueError, match="TwoTensor"):
        ls.load({"q": wrapped}, path)
    assert torch.equal(wrapped.a, torch.ones(3)) and torch.equal(wrapped.b, torch.zeros(3))


class _Plain(torch.Tensor):
    """A subclass without a dispatch of its own (as_subclass): its memory is its values."""


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_plain_subclass_is_saved_and_loaded_into(tmp_path, suffix) -> None:
    value = torch.randn(3, 4).as_subclass(_Plain)
    path = tmp_path / f"p{suffix}"
    ls.save({"p": value}, path)
    into = torch.zeros(3, 4).as_subclass(_Plain)
    ls.load({"p": into}, path)
    assert torch.equal(into.as_subclass(torch.Tensor), value.as_subclass(torch.Tensor))
