"""``load`` installs the words its verify pass checked (issue 13): a tensor that fits in
``KEPT_VERIFIED_BYTES`` is read once, not once to verify and again to install; the others
are read again as before; nothing is installed when any tensor fails its checks. CPU torch
targets are filled by numpy's copy, block by block as well as whole."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import lean_store as ls
import lean_store.checkpoint as checkpoint_module
from lean_store.checkpoint import Checkpoint
from lean_store.errors import IntegrityError
from lean_store.layout import Entry

torch = pytest.importorskip("torch")

SUFFIXES = [".h5", ".zarr"]


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "big": rng.standard_normal((256, 64)).astype(np.float32),  # 64 KiB
        "vec": rng.standard_normal(33).astype(np.float32),
        "ints": np.arange(10, dtype=np.int64),
        "flags": np.array([True, False, True]),
        "scalar": np.float64(3.5),
        "pairs": (rng.standard_normal(6) + 1j * rng.standard_normal(6)).astype(np.complex64),
    }


def _reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    counts: Counter[str] = Counter()
    blocks, read_whole = Checkpoint.blocks, Checkpoint._read_whole
    inside = threading.local()  # a whole read's own blocks are that one read (per thread)

    def counting(self: Checkpoint, name: str, **kwargs: object):  # type: ignore[no-untyped-def]
        if not getattr(inside, "now", False):
            counts[name] += 1
        return blocks(self, name, **kwargs)  # type: ignore[arg-type]

    def counting_whole(self: Checkpoint, entry: Entry, out: np.ndarray) -> None:
        counts[entry.name] += 1
        inside.now = True
        try:
            read_whole(self, entry, out)
        finally:
            inside.now = False

    monkeypatch.setattr(Checkpoint, "blocks", counting)
    monkeypatch.setattr(Checkpoint, "_read_whole", counting_whole)
    return counts


def _zeros_like(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.zeros_like(v) if isinstance(v, np.ndarray) else np.zeros((), type(v))
            for k, v in state.items()}


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_each_tensor_is_read_once(tmp_path: Path, suffix: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    path = tmp_path / f"c{suffix}"
    ls.save(state, path)
    target = _zeros_like(state)
    counts = _reads(monkeypatch)
    result = ls.load(target, path)
    assert result.loaded == list(state)
    assert counts == Counter({name: 1 for name in state})
    for name, value in state.items():
        np.testing.assert_array_equal(target[name], value)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_tensors_beyond_the_budget_are_read_again(tmp_path: Path, suffix: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    path = tmp_path / f"c{suffix}"
    ls.save(state, path)
    # "big" (64 KiB) does not fit; the small ones after it do
    monkeypatch.setattr(checkpoint_module, "KEPT_VERIFIED_BYTES", 1024)
    target = _zeros_like(state)
    counts = _reads(monkeypatch)
    ls.load(target, path)
    assert counts["big"] == 2
    assert all(counts[name] == 1 for name in state if name != "big")
    for name, value in state.items():
        np.testing.assert_array_equal(target[name], value)


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("budget", [0, 64 << 20])
def test_nothing_installed_when_a_later_tensor_is_corrupt(tmp_path: Path, suffix: str,
                                                          budget: int,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(checkpoint_module, "KEPT_VERIFIED_BYTES", budget)
    state = {"a": np.ones(64, np.float32), "b": np.full(64, 2.0, np.float32)}
    path = tmp_path / f"c{suffix}"
    ls.save(state, path)
    with ls.open(path) as ck:  # where "b"'s words lie: flip one bit of them
        words = ck.read_bits("b").tobytes()
    data = path / "b" / "c.0" if suffix == ".zarr" else path
    raw = bytearray(data.read_bytes())
    at = raw.find(words)
    assert at >= 0
    raw[at + 5] ^= 0x10
    data.write_bytes(bytes(raw))
    target = {"a": np.zeros(64, np.float32), "b": np.zeros(64, np.float32)}
    with pytest.raises(IntegrityError):
        ls.load(target, path)
    assert not target["a"].any() and not target["b"].any()


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("budget", [0, 64 << 20])
def test_torch_targets_whole_and_in_blocks(tmp_path: Path, suffix: str, budget: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint_module, "KEPT_VERIFIED_BYTES", budget)
    torch.manual_seed(0)
    state = {
        "w": torch.randn(300, 40),  # several row blocks of 4 KiB chunks
        "bf": torch.randn(70, 3).to(torch.bfloat16),
        "c": torch.randn(50, dtype=torch.complex64),
        "b": torch.tensor([True, False, True]),
        "s": torch.tensor(2.5, dtype=torch.float64),
        "i8": torch.arange(-5, 5, dtype=torch.int8),
    }
    path = tmp_path / f"t{suffix}"
    ls.save(state, path, chunk_bytes=4096)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    base = torch.zeros(300, 80)
    target["w"] = base[:, 20:60]  # a non-contiguous target: written through its view
    assert not target["w"].is_contiguous()
    ls.load(target, path)
    for name, value in state.items():
        assert torch.equal(target[name].view(torch.uint8) if name == "b" else target[name],
                           value.view(torch.uint8) if name == "b" else value), name
    assert not base[:, :20].any() and not base[:, 60:].any()


def test_a_tensor_numpy_cannot_view_is_copied_by_torch() -> None:
    from lean_store.sources.torch_source import _numpy_view

    plain = torch.arange(4, dtype=torch.int32)
    assert _numpy_view(plain) is not None
    conjugate = torch.ones(3, dtype=torch.complex64).conj()  # a lazy view: numpy has none
    assert conjugate.is_conj()
    assert _numpy_view(conjugate) is None  # then TorchTarget.write uses copy_
