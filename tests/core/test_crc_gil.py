"""CRC-32C of long buffers through ``crc32c``, which releases the GIL (google_crc32c holds it
for the whole call: a CRC pass on one thread stopped every other thread's Python). Both give
the same values; short buffers and a missing ``crc32c`` keep google_crc32c."""

from __future__ import annotations

import google_crc32c
import numpy as np
import pytest

import lean_store as ls
from lean_store import integrity

RNG = np.random.default_rng(64)


@pytest.mark.parametrize("size", [0, 1, 63, 4096, integrity.RELEASE_BYTES - 1,
                                  integrity.RELEASE_BYTES, (1 << 20) + 7])
@pytest.mark.parametrize("start", [0, 0xFFFFFFFF, 0x1234ABCD])
def test_same_value_as_google_crc32c(size: int, start: int) -> None:
    data = RNG.integers(0, 256, size, dtype=np.uint8)
    want = google_crc32c.extend(start, data.tobytes())
    assert integrity.crc32c_extend(start, data) == want
    assert integrity.crc32c_extend(start, data.tobytes()) == want
    assert integrity.crc32c_of(data.view(np.uint8), start) == want
    if size % 4 == 0 and size:  # a 2-D array: its bytes, however its first axis is sized
        assert integrity.crc32c_extend(start, data.reshape(4, -1)) == want


def test_long_buffers_go_to_the_gil_releasing_library(monkeypatch: pytest.MonkeyPatch) -> None:
    assert integrity._RELEASED is not None  # a dependency: crc32c >= 2.7
    calls: list[int] = []
    real = integrity._RELEASED

    def spy(data, crc):
        calls.append(len(data))
        return real(data, crc)

    monkeypatch.setattr(integrity, "_RELEASED", spy)
    state = {"big": RNG.standard_normal(1 << 16, dtype=np.float32),  # 256 KiB
             "small": RNG.standard_normal(8, dtype=np.float32)}
    for _ in range(2):
        assert integrity.crc32c_of(state["big"]) == google_crc32c.value(state["big"].tobytes())
    assert calls == [state["big"].nbytes] * 2
    assert integrity.crc32c_of(state["small"]) == google_crc32c.value(state["small"].tobytes())
    assert len(calls) == 2  # a short buffer: not handed over


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
@pytest.mark.parametrize("compression", [None, "weights"])
def test_saves_and_loads_without_crc32c(tmp_path, monkeypatch: pytest.MonkeyPatch, suffix: str,
                                        compression: str | None) -> None:
    """Without ``crc32c`` every CRC is google_crc32c's: the same files, the same checks."""
    state = {"w": RNG.standard_normal((256, 300), dtype=np.float32),
             "b": RNG.standard_normal(7, dtype=np.float32)}
    ls.save(state, tmp_path / f"with{suffix}", compression=compression)
    monkeypatch.setattr(integrity, "_RELEASED", None)
    ls.save(state, tmp_path / f"without{suffix}", compression=compression)
    for name in ("with", "without"):
        got = ls.load_state(tmp_path / f"{name}{suffix}")
        assert all(got[k].tobytes() == v.tobytes() for k, v in state.items())
        assert ls.verify(tmp_path / f"{name}{suffix}").ok
    monkeypatch.undo()
    got = ls.load_state(tmp_path / f"without{suffix}")
    assert got["w"].tobytes() == state["w"].tobytes()
