"""A whole-tensor read of a one-chunk tensor (``read_bits``, ``verified_words``, every
``load_state``) skips the block stream but keeps its checks: the store's checked read of the
chunk, the digest from the chunk's recorded CRC (no second pass over the words), or a CRC pass
when the store keeps no table; the same words and errors as the block stream."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import ALL_FORMATS, sample_bits

import lean_store as ls
from lean_store import checkpoint
from lean_store.errors import IntegrityError


def _spy(ck: ls.Checkpoint, calls: list[str]) -> None:
    reader = ck._reader
    read, crcs = reader.read, reader.chunk_crcs

    def spy_read(*args: Any, **kwargs: Any) -> Any:
        calls.append("read")
        return read(*args, **kwargs)

    def spy_crcs(node: str) -> Any:
        calls.append("chunk_crcs")
        return crcs(node)

    reader.read = spy_read  # type: ignore[method-assign]
    reader.chunk_crcs = spy_crcs  # type: ignore[method-assign]


def _no_stream(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a one-chunk tensor went through the block stream")


def _stream_words(ck: ls.Checkpoint, name: str) -> np.ndarray:
    """The block stream's words of ``name`` (the general path)."""
    return np.concatenate([w.reshape(-1) for _, w in ck.blocks(name)]) \
        if ck.layout[name].nbytes else np.empty(0)


def test_one_chunk_read_is_one_checked_read_and_no_second_crc_pass(
    tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / f"ck{suffix}"
    state = {f"t{i}": np.arange(i, i + 40, dtype=np.float32) for i in range(5)}
    ls.save(state, path, progress=False)
    passes: list[int] = []
    update = checkpoint.crc32c_update
    monkeypatch.setattr(checkpoint, "crc32c_update",
                        lambda crc, words: passes.append(words.nbytes) or update(crc, words))
    monkeypatch.setattr(ls.Checkpoint, "_stream", _no_stream)  # no generator per tensor
    with ls.open(path) as ck:
        assert ck.stored("t0").chunk_shape == (40,)  # one chunk: the case under test
        calls: list[str] = []
        _spy(ck, calls)
        for name, value in state.items():
            calls.clear()
            np.testing.assert_array_equal(ck.read_bits(name), value.view(np.uint32))
            assert calls == ["chunk_crcs", "read"]  # table first, as the stream does
        region, words = ck.verified_words("t3")
        np.testing.assert_array_equal(words, state["t3"].view(np.uint32))
        assert region == (slice(0, 40),)
    assert passes == []  # the digest came from the chunk's recorded CRC


def test_one_chunk_read_checks_the_digest(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"ck{suffix}"
    ls.save({"w": np.ones(16, np.float32)}, path, progress=False)
    with ls.open(path) as ck:
        good = ck.stored("w").attrs["crc32c"]
        ck.stored("w").attrs["crc32c"] = good ^ 1  # the recorded digest disagrees
        with pytest.raises(IntegrityError, match=r"tensor 'w': crc32c .* does not match"):
            ck.read_bits("w")
        with pytest.raises(IntegrityError, match="tensor 'w'"):
            ck.verified_words("w")
    with pytest.raises(IntegrityError, match="tensor 'w'"):  # the chunk itself damaged
        _damage_chunk(path, suffix)
        ls.load_state(path)


def test_one_chunk_read_without_a_table_computes_the_digest(
    tmp_path: Path, suffix: str
) -> None:
    path = tmp_path / f"ck{suffix}"
    value = np.linspace(0, 1, 24, dtype=np.float32)
    ls.save({"w": value}, path, progress=False)
    with ls.open(path) as ck:
        ck._reader.chunk_crcs = lambda node: None  # type: ignore[method-assign]
        np.testing.assert_array_equal(ck.read_bits("w"), value.view(np.uint32))
        ck.stored("w").attrs["crc32c"] ^= 1
        with pytest.raises(IntegrityError, match=r"tensor 'w': crc32c .* does not match"):
            ck.read_bits("w")


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=str)
def test_one_chunk_and_stream_give_the_same_words(
    tmp_path: Path, suffix: str, fmt: ls.ScalarFormat
) -> None:
    path = tmp_path / f"ck{suffix}"
    bits = sample_bits(fmt, np.random.default_rng(1))
    state = {"v": ls.Encoded(bits, fmt), "s": ls.Encoded(bits[0], fmt)}  # s: a scalar
    ls.save(state, path, progress=False)
    with ls.open(path) as ck:
        for name, value in state.items():
            got = ck.read_bits(name)
            np.testing.assert_array_equal(got, value.bits)
            np.testing.assert_array_equal(got.reshape(-1), _stream_words(ck, name))


def test_several_chunks_and_empty_tensors_take_the_stream(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"ck{suffix}"
    big = np.arange(4096, dtype=np.float32).reshape(64, 64)
    ls.save({"big": big, "empty": np.zeros((0, 3), np.float32)}, path, progress=False,
            chunk_bytes=4096)
    with ls.open(path) as ck:
        assert ck.stored("big").chunk_shape != (64, 64)  # several chunks
        calls: list[str] = []
        _spy(ck, calls)
        np.testing.assert_array_equal(ck.read_bits("big"), big.view(np.uint32))
        assert calls.count("read") > 1  # block by block
        assert ck.read_bits("empty").shape == (0, 3)
        ck.stored("big").attrs["crc32c"] ^= 1
        with pytest.raises(IntegrityError, match="tensor 'big'"):
            ck.read_bits("big")


def _damage_chunk(path: Path, suffix: str) -> None:
    """Flip one byte of the only tensor's data (the words' first byte in the file)."""
    needle = np.ones(16, np.float32).tobytes()
    files = [path] if suffix == ".h5" else [p for p in path.rglob("*") if p.is_file()
                                            and p.name != "zarr.json"]
    for f in files:
        data = bytearray(f.read_bytes())
        at = data.find(needle)
        if at >= 0:
            data[at] ^= 0xFF
            f.write_bytes(bytes(data))
            return
    raise AssertionError("tensor data not found")
