"""``compression="weights"`` frames are those lean_store asks for, whatever ``BLOSC_*``
variables the environment holds. c-blosc's global path (numcodecs takes it on the main thread)
applies them to every frame: ``BLOSC_COMPRESSOR=lz4`` wrote lz4 frames under filter parameters
and ``zarr.json`` documents that say zstd, and ``BLOSC_SPLITMODE=`` made an HDF5 save fail with
numcodecs' ``RuntimeError``. A frame c-blosc still gets wrong is a typed error, and nothing is
saved with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from numcodecs import blosc

import lean_store as ls
from lean_store.stores import blosc_frames

RNG = np.random.default_rng(23)
STATE = {
    "tiny": RNG.standard_normal((3, 64)).astype(np.float32),  # compressed on the caller
    "mid": RNG.standard_normal((1000, 64)).astype(np.float32),
    "big": RNG.standard_normal((40000, 64)).astype(np.float32),  # several chunks
    "half": RNG.standard_normal((700, 33)).astype(np.float16),
}
ZSTD = 4  # the format code of zstd in a Blosc 1 frame's flags


def _frames(path: Path) -> dict[str, bytes]:
    """Every stored chunk's bytes, by dataset or file name."""
    if path.suffix == ".h5":
        found = {}
        with h5py.File(path, "r") as f:
            for name, node in f.items():
                if isinstance(node, h5py.Dataset) and node.chunks:
                    for i in range(node.id.get_num_chunks()):
                        offset = node.id.get_chunk_info(i).chunk_offset
                        found[f"{name}{offset}"] = node.id.read_direct_chunk(offset)[1]
        return found
    return {str(p.relative_to(path)): p.read_bytes()
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != "zarr.json"}


def _save(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    ls.save(STATE, path, compression="weights")
    back = ls.load_state(path)
    assert all(np.array_equal(back[k], v) for k, v in STATE.items())
    ls.verify(path).raise_if_bad()
    return path


@pytest.fixture
def global_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """numcodecs as it is once any Blosc call of the process made its lock: the main thread
    takes c-blosc's global path (the one that reads the environment)."""
    monkeypatch.setattr(blosc, "use_threads", None)
    if hasattr(blosc, "get_mutex"):
        blosc.get_mutex()


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_environment_changes_no_frame(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      global_path: None, suffix: str) -> None:
    clean = _frames(_save(tmp_path, "clean" + suffix))
    monkeypatch.setenv("BLOSC_COMPRESSOR", "lz4")
    monkeypatch.setenv("BLOSC_CLEVEL", "9")
    monkeypatch.setenv("BLOSC_BLOCKSIZE", "4096")
    monkeypatch.setenv("BLOSC_SHUFFLE", "NOSHUFFLE")
    with_env = _frames(_save(tmp_path, "env" + suffix))
    assert with_env == clean
    assert clean and all(frame[2] >> 5 == ZSTD for frame in clean.values())


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_value_c_blosc_refuses_does_not_fail_the_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, global_path: None, suffix: str) -> None:
    clean = _frames(_save(tmp_path, "clean" + suffix))
    monkeypatch.setenv("BLOSC_SPLITMODE", "")  # c-blosc: "not recognized", compression fails
    assert _frames(_save(tmp_path, "env" + suffix)) == clean


def _failing(kind: str) -> Any:
    real = blosc.compress

    def compress(source: Any, cname: bytes, *args: Any, **kwargs: Any) -> bytes:
        if kind == "raises":
            raise RuntimeError("error during blosc compression: -1")
        return real(source, b"lz4", *args, **kwargs)  # what BLOSC_COMPRESSOR=lz4 makes

    return compress


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
@pytest.mark.parametrize("kind", ["raises", "other-codec"])
def test_a_frame_other_than_asked_fails_typed_and_keeps_the_previous_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str, kind: str) -> None:
    path = _save(tmp_path, "ckpt" + suffix)
    before = _frames(path)
    monkeypatch.setenv("BLOSC_COMPRESSOR", "lz4")
    monkeypatch.setattr(blosc, "compress", _failing(kind))
    changed = {k: v + 1 for k, v in STATE.items()}
    with pytest.raises(ls.CheckpointError) as caught:
        ls.save(changed, path, compression="weights")
    message = str(caught.value)
    assert "BLOSC_COMPRESSOR='lz4'" in message
    assert ("could not compress" if kind == "raises" else "other than asked") in message
    monkeypatch.undo()
    assert _frames(path) == before  # the previous checkpoint, untouched
    back = ls.load_state(path)
    assert all(np.array_equal(back[k], v) for k, v in STATE.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary left


def test_frame_check_reads_codec_shuffle_and_type_size() -> None:
    data = RNG.standard_normal(5000).astype(np.float32)
    check = blosc_frames._compress_checked
    assert check(data, b"zstd", 1, blosc.SHUFFLE, 1 << 20, 4)[2] >> 5 == ZSTD
    assert check(data, b"lz4", 1, blosc.BITSHUFFLE, 1 << 20, 4)[2] & 0x05 == 0x04
    assert check(data.view(np.uint8), b"zstd", 1, blosc.NOSHUFFLE, 0, 1)[3] == 1
