"""The direct Zarr shard reader: same values as zarr, every chunk and index CRC checked,
hostile shard indexes rejected, only the chunks a selection needs read, and a fallback to
zarr for any other layout."""

from __future__ import annotations

from pathlib import Path

import google_crc32c
import numpy as np
import pytest

import lean_store as ls
import lean_store.stores.zarr.direct_read as zdr

CHUNK = 1 << 14  # 16 KiB chunks: the 1000 x 300 float32 tensor is sharded, 8 chunks a shard


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "a": rng.random((1000, 300), dtype=np.float32),
        "c": (rng.random((77, 5)) + 1j).astype(np.complex64),
        "s": np.float64(3.0),
        "b": rng.random((4000, 33)) > 0.5,
    }


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    state = _state()
    path = tmp_path / "x.zarr"
    ls.save(state, path, chunk_bytes=CHUNK)
    return path, state


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    seen: list[tuple[int, ...]] = []
    orig = zdr.DirectReader._read_chunk

    def spy(self: zdr.DirectReader, coords: tuple[int, ...], dst: np.ndarray, *args, **kwargs
            ) -> int | None:
        seen.append(coords)
        return orig(self, coords, dst, *args, **kwargs)

    monkeypatch.setattr(zdr.DirectReader, "_read_chunk", spy)
    return seen


def test_values_and_partial_reads(saved: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch
                                  ) -> None:
    path, state = saved
    seen = _count_reads(monkeypatch)
    out = ls.load_state(path)
    for name, value in state.items():
        assert np.array_equal(np.asarray(out[name]), value), name
    assert seen  # the direct reader did the reads
    with ls.open(path) as ck:
        seen.clear()
        assert np.array_equal(ck["a"][5:900:7, 3:250:3], state["a"][5:900:7, 3:250:3])
        assert np.array_equal(ck["c"][3:50:4], state["c"][3:50:4])
        assert np.array_equal(ck["b"][-1], state["b"][-1])
        seen.clear()
        rows = ck["a"].chunks[0]
        ck["a"][rows + 1: rows + 3]  # inside the second chunk: that chunk only
        assert seen == [(1, 0)]


def _shard(path: Path) -> Path:
    files = sorted(p for p in (path / "a").rglob("*") if p.is_file() and p.name != "zarr.json")
    return files[0]


def _rewrite_index(shard: Path, change: object) -> None:
    data = bytearray(shard.read_bytes())
    slots = 8  # chunks per shard (stores.zarr_store.SHARD_FACTOR)
    start = len(data) - (16 * slots + 4)
    index = np.frombuffer(bytes(data[start:-4]), "<u8").reshape(slots, 2).copy()
    change(index)  # type: ignore[operator]
    raw = index.tobytes()
    data[start:] = raw + google_crc32c.value(raw).to_bytes(4, "little")
    shard.write_bytes(bytes(data))


def _set_entry(offset: int, nbytes: int) -> object:
    def change(index: np.ndarray) -> None:
        index[1] = (offset, nbytes)

    return change


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ("chunk", "fails its crc32c"),
        ("index", "index fails its crc32c"),
        ("empty", "missing from shard"),
        ("far", "bad shard index entry"),
        ("long", "bad shard index entry"),
    ],
)
def test_damage_detected_before_use(saved: tuple[Path, dict], damage: str, match: str) -> None:
    path, state = saved
    shard = _shard(path)
    if damage == "chunk":
        data = bytearray(shard.read_bytes())
        data[CHUNK + 100] ^= 1  # inside the second chunk
        shard.write_bytes(bytes(data))
    elif damage == "index":
        data = bytearray(shard.read_bytes())
        data[-10] ^= 1
        shard.write_bytes(bytes(data))
    elif damage == "empty":
        _rewrite_index(shard, _set_entry(2**64 - 1, 2**64 - 1))
    elif damage == "far":
        _rewrite_index(shard, _set_entry(2**63, CHUNK + 4))
    else:
        _rewrite_index(shard, _set_entry(0, 2**62))
    with pytest.raises(ls.IntegrityError, match=match):
        ls.load_state(path)
    target = {k: np.zeros_like(v) for k, v in state.items()}
    with pytest.raises(ls.IntegrityError, match=match):
        ls.load(target, path)
    assert all(not np.any(v) for v in target.values())  # unchanged


def test_missing_shard_file(saved: tuple[Path, dict]) -> None:
    path, _ = saved
    _shard(path).unlink()
    with pytest.raises(ls.IntegrityError):
        ls.load_state(path)


def test_compressed_store_uses_zarr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    path = tmp_path / "z.zarr"
    ls.save(state, path, chunk_bytes=CHUNK, compression="zstd")
    seen = _count_reads(monkeypatch)
    out = ls.load_state(path)
    assert np.array_equal(out["a"], state["a"])
    assert seen == []  # not the direct layout: zarr's pipeline read it
