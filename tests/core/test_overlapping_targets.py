"""A load target whose elements share memory (an ``expand()``ed or broadcast view, an
overlapping ``as_strided`` view) cannot hold a checkpoint's values: of the elements that share
memory the last one written wins. ``ls.load`` reported success and left such a view holding the
last row in every row; it is now refused before anything is installed, as torch's own
``copy_`` refuses an expanded tensor. Views that do not overlap (transposed, strided,
interleaved) load exactly."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided
from torch_optional import needs_torch, torch

import lean_store as ls
from lean_store.sources.base import EXACT_OVERLAP_ELEMENTS, elements_overlap

SUFFIXES = [".h5", ".zarr"]


def _saved(tmp_path, suffix: str) -> str:
    path = str(tmp_path / f"ck{suffix}")
    ls.save({"e": np.arange(12, dtype=np.float32).reshape(3, 4),
             "f": np.arange(4, dtype=np.float32)}, path)
    return path


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_an_overlapping_numpy_view_is_refused_before_anything_is_installed(tmp_path, suffix):
    path = _saved(tmp_path, suffix)
    base = np.zeros(6, dtype=np.float32)
    other = np.full(4, -1, dtype=np.float32)
    overlapping = as_strided(base, shape=(3, 4), strides=(4, 4))  # rows one element apart
    with pytest.raises(ls.UnsupportedValueError, match="'e'.*share memory.*clone"):
        ls.load({"f": other, "e": overlapping}, path)
    assert (base == 0).all() and (other == -1).all()


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_views_that_do_not_overlap_load_exactly(tmp_path, suffix):
    path = _saved(tmp_path, suffix)
    want = np.arange(12, dtype=np.float32).reshape(3, 4)
    transposed = np.zeros((4, 3), dtype=np.float32).T
    strided = np.zeros((6, 8), dtype=np.float32)[::2, ::2]
    # interleaved: offsets 0, 3, 6, 9, 2, 5, ... (strides 2 and 3 elements): no two meet,
    # though the strides alone cannot tell
    interleaved = as_strided(np.zeros(32, dtype=np.float32), shape=(3, 4), strides=(8, 12))
    for target in (transposed, strided, interleaved):
        ls.load({"e": target, "f": np.zeros(4, dtype=np.float32)}, path)
        assert np.array_equal(target, want)


def test_the_overlap_rule() -> None:
    assert not elements_overlap((3, 4), (16, 4), 4)  # C order
    assert not elements_overlap((3, 4), (4, 12), 4)  # F order
    assert not elements_overlap((3, 4), (-16, 4), 4)  # a flipped view
    assert elements_overlap((3, 4), (0, 4), 4)  # expanded rows
    assert elements_overlap((4,), (2,), 4)  # float32 elements 2 bytes apart
    assert not elements_overlap((3, 4), (8, 12), 4)  # interleaved, compared one by one
    assert elements_overlap((3, 4), (4, 12), 8)  # the same offsets, 8-byte elements: overlap
    assert not elements_overlap((0, 4), (0, 4), 4)  # no elements
    assert not elements_overlap((1, 5), (0, 4), 4)  # a length-1 axis of stride 0
    # past the bound of the one-by-one comparison, a view the strides cannot clear is refused
    assert elements_overlap((EXACT_OVERLAP_ELEMENTS + 1, 2), (8, 12), 4)
    assert not elements_overlap((100, 2), (8, 12), 4)  # the same view, small: compared


@needs_torch
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_an_expanded_torch_tensor_is_refused_as_torch_refuses_it(tmp_path, suffix):
    path = _saved(tmp_path, suffix)
    other = torch.full((4,), -1.0)
    expanded = torch.zeros(1, 4).expand(3, 4)
    with pytest.raises(RuntimeError, match="single memory location"):  # torch's own copy_
        expanded.copy_(torch.ones(3, 4))
    with pytest.raises(ls.UnsupportedValueError, match="'e'.*share memory"):
        ls.load({"f": other, "e": expanded}, path)
    assert (expanded == 0).all() and (other == -1).all()
    overlapping = torch.zeros(6).as_strided((3, 4), (1, 1))
    with pytest.raises(ls.UnsupportedValueError, match="'e'.*share memory"):
        ls.load({"f": other, "e": overlapping}, path)
    channels_last = torch.zeros(3, 4, 1, 1).to(memory_format=torch.channels_last)
    ls.load({"f": other, "e": channels_last.view(3, 4)}, path)
    assert torch.equal(channels_last.view(3, 4), torch.arange(12.0).reshape(3, 4))
