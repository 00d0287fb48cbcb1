"""``ls.load`` into numpy arrays of non-native byte order (``'>f4'``: FITS data, arrays read
from a big-endian file, ``np.frombuffer(..., '>f4')``): every value arrives exactly, NaN
payloads included. Before, the native words were copied into the big-endian memory as they
were, and every value came out byte-swapped, silently."""

from __future__ import annotations

import numpy as np
import pytest

import lean_store as ls

BACKENDS = [".h5", ".zarr"]
WORDS = {  # bit patterns that a value conversion could change: NaN payloads, -0, subnormals
    "f2": np.array([0x7C01, 0xFE00, 0x8000, 0x0001, 0x3C00], np.uint16),
    "f4": np.array([0x7F800001, 0xFFC00123, 0x80000000, 0x00000001, 0x3F800000], np.uint32),
    "f8": np.array([0x7FF0000000000001, 0x8000000000000000, 1, 0x3FF0000000000000], np.uint64),
}


def _values() -> dict[str, np.ndarray]:
    out = {f"f{k[1:]}": w.view(f"<{k}") for k, w in WORDS.items()}
    out.update({
        "i2": np.array([-2, 300], "<i2"), "i4": np.array([-7, 2**30], "<i4"),
        "i8": np.array([-(2**62), 5], "<i8"), "u2": np.array([65535, 1], "<u2"),
        "u4": np.array([2**32 - 1, 7], "<u4"), "u8": np.array([2**64 - 1, 3], "<u8"),
        "c8": np.array([1 + 2j, -0.0 - 3.5j], "<c8"), "c16": np.array([np.pi - 1j], "<c16"),
        "m": np.arange(12, dtype="<f4").reshape(3, 4),
    })
    return out


@pytest.mark.parametrize("suffix", BACKENDS)
@pytest.mark.parametrize("verify", [True, False])
def test_big_endian_targets_get_every_bit(tmp_path, suffix, verify) -> None:
    state = _values()
    path = tmp_path / f"s{suffix}"
    ls.save(state, path)
    targets = {n: np.zeros(v.shape, v.dtype.newbyteorder(">")) for n, v in state.items()}
    ls.load(targets, path, verify=verify)
    for name, want in state.items():
        got = targets[name]
        assert got.dtype.byteorder == ">"
        native = got.astype(want.dtype)  # a byte swap, no value conversion
        assert native.tobytes() == want.tobytes(), name
    # strided big-endian views too
    base = np.zeros((3, 8), ">f4")
    with pytest.warns(UserWarning, match="11 unexpected"):
        ls.load({"m": base[:, ::2]}, path, strict=False)
    assert np.array_equal(base[:, ::2].astype("<f4"), state["m"])
    assert not base[:, 1::2].any()
