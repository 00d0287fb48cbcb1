"""Partial reads follow numpy's basic indexing exactly, compared with numpy on the same array:
ints, slices with any step, ``...`` and ``None`` (a new axis, refused before). A boolean index
(``h[True]``, ``h[False]``), which numpy reads as a mask, was taken as the int 1 or 0 and
returned a row: now refused, like integer and boolean arrays (advanced indexing)."""

from __future__ import annotations

import numpy as np
import pytest

import lean_store as ls

A = np.arange(40 * 6 * 7, dtype=np.float32).reshape(40, 6, 7)
KEYS = [
    (slice(None),), (1,), (-1,), (slice(None, None, -1),), (Ellipsis, 2), (None, 1),
    (1, Ellipsis, slice(2, 5)), (slice(1, 4), -2, slice(None, None, 2)), (slice(50, 60),),
    (slice(-100, 100),), (np.int64(2),), (np.array(2),), (slice(3, 1),), (None,),
    (None, None), (Ellipsis, None), (1, None, slice(2, 4)), (None, Ellipsis, 3, None),
    (slice(None, None, -2), None, -1), (None, 1, 2, 3, None),
]


@pytest.fixture(params=[".h5", ".zarr"])
def stored(request, tmp_path):
    path = tmp_path / f"a{request.param}"
    ls.save({"a": A, "s": np.float32(3.5), "c": (A[:2, :2, 0] + 1j).astype(np.complex64)},
            path, chunk_bytes=1024)
    with ls.open(path) as ck:
        yield ck


@pytest.mark.parametrize("key", KEYS, ids=repr)
def test_basic_indexes_read_what_numpy_reads(stored, key) -> None:
    got = stored["a"][key]
    want = A[key]
    assert got.shape == want.shape and np.array_equal(got, want)


def test_new_axes_on_scalars_and_complex_values(stored) -> None:
    s = np.float32(3.5)
    for key in [(None,), (Ellipsis, None), (None, Ellipsis, None)]:
        assert stored["s"][key].shape == np.asarray(s)[key].shape
    c = (A[:2, :2, 0] + 1j).astype(np.complex64)
    for key in [(None, 1), (slice(None), None, 0), (Ellipsis, None)]:
        got = stored["c"][key]
        assert got.shape == c[key].shape and np.array_equal(got, c[key])


@pytest.mark.parametrize("key", [True, False, np.bool_(True), (1, False)], ids=repr)
def test_a_boolean_index_is_refused_not_read_as_a_row(stored, key) -> None:
    with pytest.raises(ls.CheckpointError, match="boolean selects with a mask"):
        stored["a"][key]


@pytest.mark.parametrize("key", [np.array([0, 2]), [0, 2], A[:, 0, 0] > 50, (0, 1, 2, 3),
                                 40, slice(0, 5, 0), 1.5], ids=repr)
def test_what_basic_indexing_cannot_read_is_a_checkpoint_error(stored, key) -> None:
    with pytest.raises(ls.CheckpointError):
        stored["a"][key]
