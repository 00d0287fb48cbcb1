"""Shared test helpers: bit-level comparison and states covering every format."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import lean_store as ls
from lean_store import formats
from lean_store.formats import of_numpy_dtype
from lean_store.layout import Layout
from lean_store.sources.base import SourceTensor, TensorSource
from lean_store.stream import CopyEngine

CONFIGURED = [
    formats.binary(5, 6),  # 12-bit IEEE-like
    formats.binary(8, 23, encoding="finite"),
    formats.binary(3, 2, encoding="finite-max-nan"),
    formats.binary(6, 9, bias=20, encoding="finite-unsigned-zero"),
    formats.complex_of(formats.get("bfloat16")),
    formats.complex_of(formats.binary(5, 6)),
]
ALL_FORMATS = list(formats.STANDARD.values()) + CONFIGURED
BACKENDS = ["hdf5", "zarr"]
SUFFIX = {"hdf5": ".h5", "zarr": ".zarr"}


def sample_bits(fmt: ls.ScalarFormat, rng: np.random.Generator, n: int = 300) -> np.ndarray:
    """Raw words: every code point for formats up to 16 bits, else random words + specials."""
    word = fmt.word_width
    dtype = fmt.storage_dtype
    if isinstance(fmt, formats.BoolFormat):
        words = np.array([0, 1, 1, 0], dtype=np.uint8)
    elif word <= 16:
        words = np.arange(1 << word, dtype=np.uint64).astype(dtype)
    else:
        top = (1 << word) - 1
        specials = [0, 1, top, top >> 1, 1 << (word - 1), (top >> 1) - 1, (1 << (word - 1)) + 1]
        rand = rng.integers(0, top, size=n, dtype=np.uint64, endpoint=True)
        words = np.concatenate([np.array(specials, dtype=np.uint64), rand]).astype(dtype)
    if fmt.words_per_value == 2:
        words = words[: len(words) // 2 * 2].reshape(-1, 2)
    return words


def value_of(bits: np.ndarray, fmt: ls.ScalarFormat) -> Any:
    """A numpy array of the format's dtype when it has one, else an Encoded."""
    dtype = fmt.numpy_dtype
    if dtype is None:
        return ls.Encoded(bits, fmt)
    if fmt.words_per_value == 2:
        return np.ascontiguousarray(bits).view(dtype).reshape(bits.shape[:-1])
    return bits.view(dtype)


def raw(value: Any) -> tuple[str, tuple[int, ...], bytes]:
    """(format tag, shape, raw little-endian bytes) of an array, Encoded or torch tensor."""
    if isinstance(value, ls.Encoded):
        return value.format.tag, value.shape, value.bits.tobytes()
    if hasattr(value, "detach"):
        import torch

        t = value.detach().cpu().contiguous()
        if t.is_complex():
            t = torch.view_as_real(t).contiguous()
            return (
                str(value.dtype),
                tuple(value.shape),
                t.reshape(-1).view(torch.uint8).numpy().tobytes(),
            )
        return str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()
    arr = np.asarray(value)
    return ls.formats.of_numpy_dtype(arr.dtype).tag, arr.shape, np.ascontiguousarray(arr).tobytes()


def assert_same_state(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert raw(a[name]) == raw(b[name]), name


def h5_text(text: str):
    """A string attribute value as lean_store writes it: fixed-length UTF-8 (no global heap)."""
    import h5py

    data = text.encode("utf-8")
    return np.array(data, dtype=h5py.string_dtype("utf-8", max(1, len(data))))


def without_save_id(files: dict[str, bytes]) -> dict[str, bytes]:
    """A Zarr store's files (relative path -> bytes) with the root's ``save_id`` (new for every
    save) blanked, so that two saves of the same state compare equal."""
    import json

    root = json.loads(files["zarr.json"])
    root["attributes"]["save_id"] = ""
    return {**files, "zarr.json": json.dumps(root, sort_keys=True).encode()}


def zarr_layout_state(seed: int, *, several_shards: bool = False) -> dict[str, Any]:
    """A state covering the Zarr layouts at ``chunk_bytes=1024`` (8 rows of 32 float32 a
    chunk; tensors of 8+ chunks are sharded): an aligned shard, partial shards and chunks,
    unsharded chunks, 1-byte, raw, complex, empty and scalar words."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    state: dict[str, Any] = {
        "aligned": rng.standard_normal((64, 32), dtype=np.float32),  # 8 chunks: 1 shard
        "edge": rng.standard_normal((77, 32), dtype=np.float32),  # partial shard and chunk
    }
    if several_shards:
        state["long"] = rng.standard_normal((200, 32), dtype=np.float32)
    state.update({
        "small": rng.standard_normal((5, 3), dtype=np.float32),  # one unsharded chunk
        "unsharded_edge": np.arange(50, dtype=np.int16),  # unsharded, edge chunk
        "mask": rng.random((41, 16)) > 0.5,  # bool, 1-byte words
        "bf16": rng.standard_normal((33, 8)).astype(ml_dtypes.bfloat16),  # raw words
        "c64": (rng.standard_normal((20, 4)) + 1j).astype(np.complex64),
        "empty": np.zeros((0, 4), np.float32),
        "scalar": np.float64(3.5),
    })
    return state


def through_zarr_python(m: Any) -> None:
    """Within the monkeypatch context ``m``, Zarr saves go through zarr-python's own
    ``create_array``, codec pipeline and CRC-32C codec (no direct writer, no lean_store
    documents): "stock" files to compare lean_store's direct writes with."""
    from zarr.codecs import Crc32cCodec

    from lean_store.stores.zarr import store as zarr_store

    m.setattr(zarr_store, "direct_ok", lambda *args, **kwargs: False)
    m.setattr(zarr_store, "PLAIN_IS_DIRECT", False)
    m.setattr(zarr_store, "crc32c_codec", Crc32cCodec)


def frozen_backbone_model() -> Any:
    """A torch model whose 96x96 first layer is frozen and whose 96x32 head trains (seeded):
    what an incremental step links and what it writes."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.Linear(96, 32))
    for p in list(model.parameters())[:2]:
        p.requires_grad_(False)
    return model


# -------------------------------------------------------------- a fake device source

class FakeDeviceEngine(CopyEngine):
    """A fake device whose copies land in the pooled host buffers at once."""

    def allocate(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def nbytes(self, tensor: Any, region: Any) -> int:
        return int(tensor.data[region].nbytes)

    def start(self, tensor: Any, region: Any, buffer: np.ndarray) -> Any:
        src = tensor.data[region]
        dst = buffer[: src.nbytes].view(src.dtype).reshape(src.shape)
        dst[...] = src
        return lambda: dst


class FakeDeviceTensor(SourceTensor):
    device = "fake:0"
    stable_reads = True  # claimed, but its units come through reused staging buffers

    def __init__(self, data: np.ndarray, engine: FakeDeviceEngine) -> None:
        self.data = data
        self.stage_engine = engine

    def read(self, region: Any) -> np.ndarray:  # pragma: no cover - staged, never read
        raise AssertionError("a device tensor goes through its engine")


class FakeDeviceSource(TensorSource):
    """A state of "device" tensors (numpy arrays behind a fake copy engine): its units come
    through the save's reused staging buffers, as a CUDA state's do."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays
        self.engine = FakeDeviceEngine()
        self.layout = Layout.from_specs(
            [(n, a.shape, of_numpy_dtype(a.dtype)) for n, a in arrays.items()])

    def tensors(self) -> Any:
        for entry in self.layout:
            yield entry, FakeDeviceTensor(self.arrays[entry.name], self.engine)


def assert_same_arrays(got: dict, want: dict) -> None:
    """``got`` holds exactly ``want``'s names, each with its dtype and bytes."""
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert np.asarray(got[key]).dtype == value.dtype
        assert np.asarray(got[key]).tobytes() == value.tobytes(), key


def wait_for_child(predicate: Callable[[], bool], proc: subprocess.Popen,
                   limit: float = 120.0) -> None:
    """Wait until ``predicate()`` holds while the child ``proc`` runs (it reached the point
    a test kills it at, say); AssertionError if it exits first or ``limit`` seconds pass."""
    deadline = time.monotonic() + limit
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"child exited early: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the child never reached the point waited for")
        time.sleep(0.02)


def zarr_chunk_file(array_dir: Path, *coords: int) -> Path:
    """The chunk (shard) file at grid ``coords`` of the Zarr array in ``array_dir``, by the
    chunk key separator its ``zarr.json`` states (``c.0.1``; ``c/0/1`` before 2026-12-05)."""
    doc = json.loads((array_dir / "zarr.json").read_text())
    sep = doc["chunk_key_encoding"]["configuration"]["separator"]
    return array_dir / ("c" + "".join(sep + str(c) for c in coords))


def zarr_chunk_files(array_dir: Path) -> list[Path]:
    """Every chunk (shard) file of the Zarr array in ``array_dir``, sorted by path."""
    return sorted(p for p in array_dir.rglob("*") if p.is_file() and p.name != "zarr.json")


def to_slash_layout(path: Path) -> None:
    """Rewrite a checkpoint as lean_store wrote it before 2026-12-05: chunk files at
    ``c/0/1`` and every document stating the separator "/" (the root's copies too)."""
    for array_dir in (p for p in path.iterdir() if p.is_dir()):
        for chunk in [p for p in array_dir.iterdir() if p.name.startswith("c.")]:
            target = array_dir.joinpath(*chunk.name.split("."))
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(chunk, target)
    for doc in path.rglob("zarr.json"):
        text = doc.read_text()
        doc.write_text(text.replace('"separator": "."', '"separator": "/"'))


def flip_bits(file: Path, at: int, mask: int) -> None:
    """XOR the byte at offset ``at`` of ``file`` with ``mask`` (damage a stored chunk)."""
    raw = bytearray(file.read_bytes())
    raw[at] ^= mask
    file.write_bytes(bytes(raw))


def damage_stored_bytes(path: Path, needle: bytes, offset: int, mask: int) -> None:
    """XOR one byte, ``offset`` bytes into the first place ``needle`` (a tensor's stored words)
    is found in the checkpoint at ``path`` (a file, or any file of a directory): damage an
    uncompressed chunk in place."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        at = file.read_bytes().find(needle)
        if at >= 0:
            flip_bits(file, at + offset, mask)
            return
    raise AssertionError("the stored bytes were not found on disk")


def preload_library(tmp_path: Path, c_source: str) -> Path:
    """``c_source`` built into a shared library for ``LD_PRELOAD`` (a system call made to fail
    as a file system without that feature makes it fail). Skips only where no C compiler is."""
    import shutil

    import pytest

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the preloaded library with")
    source = tmp_path / "preload.c"
    source.write_text(c_source)
    library = tmp_path / "preload.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)],
                   check=True, capture_output=True, timeout=120)
    return library
