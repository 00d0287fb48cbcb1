"""Flip bits and bytes in saved checkpoints: in chunk data, metadata and attributes.

Every flip must be detected by ``verify``/``load_state`` with a typed ``CheckpointError``, or be
proven harmless: the checkpoint still loads and its bits equal the original ones exactly. A
crash, hang, untyped error or silently different data fails. Cases are checked by
``tools/fuzz_soak.py --check`` in its guarded worker process. Run with ``-s`` to see the table
of outcomes.
"""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter
from pathlib import Path

import h5py
import ml_dtypes
import numpy as np
import pytest
from helpers import damage_stored_bytes
from tool_runner import run_tool

import lean_store as ls

FLIPS = {"chunk data": 40, "metadata": 50, "attributes": 30}


def _state() -> dict[str, np.ndarray]:
    """Several formats, several chunks each at chunk_bytes=1024."""
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((40, 24)).astype(np.float32),
        "bf": rng.standard_normal((30, 7)).astype(ml_dtypes.bfloat16),
        "i": rng.integers(-1000, 1000, 90).astype(np.int64),
        "c": (rng.standard_normal(20) + 1j).astype(np.complex128),
        "s": np.float64(1.5) * np.ones(()),
    }


def _text(value: str | bytes) -> bytes:
    """Attribute text as stored: lean_store writes fixed-length UTF-8 strings (h5py: bytes)."""
    return value if isinstance(value, bytes) else value.encode()


def _hdf5_regions(path: Path) -> dict[str, list[tuple[Path, int]]]:
    """Byte offsets of chunk payloads, attribute text, and everything else."""
    data: set[int] = set()
    with h5py.File(path, "r") as f:
        for ds in f.values():
            for i in range(ds.id.get_num_chunks()):
                info = ds.id.get_chunk_info(i)
                data.update(range(info.byte_offset, info.byte_offset + info.size))
        texts = [_text(v) for v in f.attrs.values() if isinstance(v, (str, bytes))]
        for ds in f.values():
            texts += [_text(v) for v in ds.attrs.values() if isinstance(v, (str, bytes))]
    raw = path.read_bytes()
    attrs: set[int] = set()
    for text in texts:
        at = raw.find(text)
        while at >= 0 and len(text) >= 4:
            attrs.update(range(at, at + len(text)))
            at = raw.find(text, at + 1)
    meta = set(range(len(raw))) - data - attrs
    return {name: [(path, i) for i in sorted(s)] for name, s in
            (("chunk data", data), ("attributes", attrs), ("metadata", meta))}


def _zarr_regions(path: Path) -> dict[str, list[tuple[Path, int]]]:
    out: dict[str, list[tuple[Path, int]]] = {"chunk data": [], "attributes": [], "metadata": []}
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        raw = file.read_bytes()
        if file.name != "zarr.json":
            out["chunk data"] += [(file, i) for i in range(len(raw))]
            continue
        start = raw.find(b'"attributes"')
        end = raw.find(b'"zarr_format"', start) if start >= 0 else -1
        end = end if end >= 0 else len(raw)
        for i in range(len(raw)):
            kind = "attributes" if start >= 0 and start <= i < end else "metadata"
            out[kind].append((file, i))
    return out


def _flip(file: Path, offset: int, rng: random.Random) -> str:
    raw = bytearray(file.read_bytes())
    if rng.random() < 0.7:
        bit = rng.randrange(8)
        raw[offset] ^= 1 << bit
        what = f"bit {bit}"
    else:
        value = rng.choice([v for v in range(256) if v != raw[offset]])
        raw[offset] = value
        what = f"byte={value:#04x}"
    file.write_bytes(bytes(raw))
    return what


def test_every_flip_is_detected_or_harmless(tmp_path, backend, suffix):
    original = tmp_path / f"orig{suffix}"
    ls.save(_state(), original, chunk_bytes=1024)
    regions = (_hdf5_regions if backend == "hdf5" else _zarr_regions)(original)
    rng = random.Random(1234)
    cases: dict[str, tuple[str, str]] = {}  # case path -> (kind, where and what was flipped)
    for kind, count in FLIPS.items():
        assert regions[kind], f"no {kind} bytes found"
        for _ in range(count):
            file, offset = rng.choice(regions[kind])
            path = tmp_path / f"case-{len(cases)}{suffix}"
            (shutil.copytree if original.is_dir() else shutil.copyfile)(original, path)
            target = path / file.relative_to(original) if path.is_dir() else path
            what = _flip(target, offset, rng)
            where = f"{file.name if file == original else file.relative_to(original)}"
            cases[str(path)] = (kind, f"{kind} {where}@{offset} {what}")
    done = run_tool("fuzz_soak.py", "--check", *cases, "--original", original)
    assert done.returncode == 0, done.stderr
    verdicts = [json.loads(line) for line in done.stdout.splitlines()]
    assert [v["case"] for v in verdicts] == list(cases)  # every case, in order
    table: dict[str, Counter] = {kind: Counter() for kind in FLIPS}
    harmless: list[str] = []
    failures: list[str] = []
    for v in verdicts:
        kind, flip = cases[v["case"]]
        table[kind][v["verdict"]] += 1
        if v["verdict"] == "harmless":
            harmless.append(flip)
        elif v["verdict"] != "detected":
            failures.append(f"{flip}: {v['verdict']}")
    print(f"\n{backend}: " + "; ".join(f"{k}: {dict(v)}" for k, v in table.items()))
    print(f"{backend} harmless flips (loaded bits equal the original): {harmless}")
    assert failures == []
    # a flip in chunk data is always caught by the chunk checksum or the digest
    assert table["chunk data"]["detected"] == FLIPS["chunk data"]


def test_verify_names_the_bad_tensor_and_chunk_and_load_leaves_target_unchanged(
    tmp_path, suffix
):
    path = tmp_path / f"ck{suffix}"
    state = {
        "good": np.arange(500, dtype=np.float32),
        "bad": np.random.default_rng(0).standard_normal((100, 32)).astype(np.float32),
    }
    ls.save(state, path, chunk_bytes=1024)  # 'bad': chunks of 8 rows (1 KiB)
    with ls.open(path) as ck:
        assert ck["bad"].chunks == (8, 32)
    row = 5 * 8 + 3  # inside chunk (5, 0)
    damage_stored_bytes(path, state["bad"][row].tobytes(), 7, 0x10)
    report = ls.verify(path)
    assert not report.ok
    assert report.bad_tensors == ["bad"]
    assert [(p.tensor, p.chunk) for p in report.problems] == [("bad", (5, 0))]
    assert "40:48" in str(report)  # the element range of the chunk
    with pytest.raises(ls.IntegrityError):
        report.raise_if_bad()
    target = {k: np.zeros_like(v) for k, v in state.items()}
    with pytest.raises(ls.IntegrityError, match="bad"):
        ls.load(target, path)
    assert all(not v.any() for v in target.values())  # nothing was installed
    # a partial read checks only the chunks it touches
    with ls.open(path) as ck:
        assert np.array_equal(ck["bad"][:40], state["bad"][:40])
        assert np.array_equal(ck["good"][:], state["good"])
        with pytest.raises(ls.IntegrityError):
            ck["bad"][40:41]
