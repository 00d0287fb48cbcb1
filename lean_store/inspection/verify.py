"""``verify(path)``: check every chunk checksum and every tensor digest, and say exactly which
tensor and which chunk is bad.

Each chunk is read on its own, so the per-chunk checksum (HDF5: the ``chunk_crc32c`` table,
and fletcher32 where the file has it; Zarr: the crc32c codec) fails for that chunk alone; the
whole-tensor crc32c digest is then checked over the chunks in C order. Structure is checked
too: every chunk present, no HDF5 filter skipped for a chunk, no empty slot in a Zarr shard
index, a checksum configured on every tensor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np

from ..chunking import Region, iter_regions
from ..errors import CheckpointError, IntegrityError, listing
from ..layout import Entry
from ..stores.base import Selection

_EMPTY = (1 << 64) - 1  # a Zarr shard index slot with no chunk
MAX_LISTED_PROBLEMS = 50  # problems str(report) names; ``problems`` holds every one


@dataclass(frozen=True)
class Problem:
    """One defect: ``tensor`` None for the checkpoint as a whole, ``chunk`` None for the tensor
    as a whole (e.g. its digest), else the chunk's coordinates in the chunk grid."""

    tensor: str | None
    chunk: tuple[int, ...] | None
    message: str

    def __str__(self) -> str:
        where = "checkpoint" if self.tensor is None else f"tensor {self.tensor!r}"
        if self.chunk is not None:
            where += f" chunk {self.chunk}"
        return f"{where}: {self.message}"


@dataclass
class VerifyReport:
    """What :func:`verify` checked and every problem it found."""

    path: str
    backend: str | None = None
    tensors: int = 0
    chunks: int = 0
    nbytes: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bad_tensors(self) -> list[str]:
        return sorted({p.tensor for p in self.problems if p.tensor is not None})

    def raise_if_bad(self) -> None:
        """Raise one :class:`IntegrityError` listing every problem, if there is any."""
        if self.problems:
            raise IntegrityError(str(self))

    def __str__(self) -> str:
        head = (
            f"{self.path}: {self.backend or '?'} checkpoint, {self.tensors} tensors, "
            f"{self.chunks} chunks, {self.nbytes} bytes checked"
        )
        if self.ok:
            return f"{head}: OK"
        lines = listing([str(p) for p in self.problems], MAX_LISTED_PROBLEMS)
        return f"{head}: {len(self.problems)} problem(s)\n{lines}"


def verify(
    path: str | os.PathLike,
    *,
    backend: str | None = None,
    isolate: bool = False,
    timeout: float | None = None,
    memory_limit: int | None = None,
) -> VerifyReport:
    """Check every chunk and digest of the checkpoint at ``path``; never raises for a bad file
    (see :meth:`VerifyReport.raise_if_bad`).

    ``isolate=True`` runs the check in a child process, for files from untrusted sources: a
    hang in libhdf5 past ``timeout`` seconds, a crash, or an allocation past ``memory_limit``
    bytes of address space becomes a reported problem instead of taking this process down.
    """
    if isolate:
        return _verify_isolated(str(path), backend, timeout, memory_limit)
    from ..checkpoint import Checkpoint

    report = VerifyReport(str(path))
    try:
        ck = Checkpoint(path, backend=backend)
    except CheckpointError as exc:
        report.problems.append(Problem(None, None, str(exc)))
        return report
    with ck:
        report.backend = ck.backend
        for entry in ck.layout:
            report.tensors += 1
            try:
                _verify_tensor(ck, entry, report)
            except CheckpointError as exc:
                report.problems.append(Problem(entry.name, None, str(exc)))
    return report


def _verify_isolated(
    path: str, backend: str | None, timeout: float | None, memory_limit: int | None
) -> VerifyReport:
    args = [sys.executable, "-m", "lean_store.inspection.verify", path, "--json"]
    if backend:
        args += ["--backend", backend]
    if memory_limit:
        args += ["--memory-limit", str(int(memory_limit))]
    report = VerifyReport(path)
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        report.problems.append(Problem(None, None, f"verification did not finish in {timeout} s"))
        return report
    if done.returncode != 0 or not done.stdout.strip():
        why = f"signal {-done.returncode}" if done.returncode < 0 else f"status {done.returncode}"
        tail = done.stderr.strip().splitlines()[-1:] if done.stderr.strip() else []
        report.problems.append(Problem(None, None, f"the reader crashed ({why}) {tail}"))
        return report
    data = json.loads(done.stdout)
    problems = [
        Problem(p["tensor"], tuple(p["chunk"]) if p["chunk"] is not None else None, p["message"])
        for p in data.pop("problems")
    ]
    return VerifyReport(problems=problems, **data)


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lean_store.inspection.verify")
    parser.add_argument("path")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--memory-limit", type=int, default=None)
    args = parser.parse_args(argv)
    if args.memory_limit:
        import resource

        import h5py  # noqa: F401 - load the libraries before the limit applies
        import zarr  # noqa: F401

        resource.setrlimit(resource.RLIMIT_AS, (args.memory_limit, args.memory_limit))
    try:
        report = verify(args.path, backend=args.backend)
    except MemoryError:
        print("allocation past the memory limit", file=sys.stderr)
        return 3
    if args.json:
        data = dataclasses.asdict(report)
        print(json.dumps(data))
    else:
        print(report)
    return 0 if report.ok or args.json else 1


def _chunk_regions(
    shape: tuple[int, ...], chunks: tuple[int, ...]
) -> Iterator[tuple[tuple[int, ...], Region]]:
    for region in iter_regions(shape, chunks):
        yield tuple(s.start // c for s, c in zip(region, chunks)), region


def _verify_tensor(ck: Any, entry: Entry, report: VerifyReport) -> None:
    from ..chunking import splits_into_row_blocks
    from ..integrity import crc32c_update

    if ck._shards.get(entry.name):  # saved by lean_store.distributed: one digest per shard
        from ..distributed.sharded_read import verify_sharded_tensor

        verify_sharded_tensor(ck, entry, report, Problem)
        return
    info = ck._stored[entry.name]
    reader = ck._reader
    for chunk, message in _structure_problems(reader, info):
        report.problems.append(Problem(entry.name, chunk, message))
    shape = entry.shape or (1,)
    chunks = tuple(info.chunk_shape[: len(shape)])
    in_order = splits_into_row_blocks(shape, chunks)  # chunks concatenate to the tensor's bytes
    crc, readable = 0, True
    for coords, region in _chunk_regions(shape, chunks):
        report.chunks += 1
        try:
            words = reader.read(info.node, Selection.of_region(region), entry.format)
        except CheckpointError as exc:
            readable = False
            report.problems.append(Problem(entry.name, coords, _chunk_message(exc, region)))
            continue
        report.nbytes += words.nbytes
        if in_order:
            crc = crc32c_update(crc, words)
    if not readable:
        return
    if not in_order:
        crc = 0
        for _region, words in ck.iter_bits(entry):  # verifies the digest itself
            crc = crc32c_update(crc, words)
        return
    expected = info.attrs.get("crc32c")
    if crc != expected:
        report.problems.append(
            Problem(
                entry.name, None,
                f"crc32c digest {crc:#010x} does not match the recorded {expected!r}; every "
                "chunk passed its own checksum, so chunks are swapped, stale or forged",
            )
        )


def _chunk_message(exc: Exception, region: Region) -> str:
    box = ", ".join(f"{s.start}:{s.stop}" for s in region)
    return f"elements [{box}] unreadable: {exc}"


# ------------------------------------------------------------------ backend structure checks


def _structure_problems(reader: Any, info: Any) -> list[tuple[tuple[int, ...] | None, str]]:
    if reader.backend == "hdf5":
        return _hdf5_structure(reader, info)
    return _zarr_structure(reader, info)


def _hdf5_structure(reader: Any, info: Any) -> list[tuple[tuple[int, ...] | None, str]]:
    problems: list[tuple[tuple[int, ...] | None, str]] = []
    if "crc32c" not in info.filters and "fletcher32" not in info.filters:
        problems.append((None, "no per-chunk checksum (no chunk_crc32c table, no fletcher32)"))
    ds = reader._dataset(info.node)
    chunks = info.chunk_shape
    try:
        skippable = _skippable_filters(ds.id.get_create_plist())
        file_size = ds.file.id.get_filesize()
        for i in range(ds.id.get_num_chunks()):
            chunk = ds.id.get_chunk_info(i)
            coords = tuple(o // c for o, c in zip(chunk.chunk_offset, chunks))
            bad = _bad_skips(chunk.filter_mask, skippable)
            if bad:
                problems.append((coords, f"filters skipped for this chunk that may not be "
                                         f"({', '.join(bad)}; mask {chunk.filter_mask})"))
            if chunk.byte_offset is None or chunk.byte_offset + chunk.size > file_size:
                problems.append((coords, "chunk lies outside the file"))
    except (OSError, RuntimeError, ValueError) as exc:
        problems.append((None, f"unreadable chunk index ({exc})"))
    return problems


def _skippable_filters(dcpl: Any) -> list[tuple[str, bool]]:
    """(name, may be skipped) for each filter of the pipeline, in order.

    HDF5 skips an *optional* filter (``H5Z_FLAG_OPTIONAL``) for a chunk it fails to encode,
    e.g. LZF on a chunk it cannot shrink, and records that in the chunk's filter
    mask; reading then returns the chunk as stored. That is normal, not damage. A mandatory
    filter is never skipped by HDF5, and a checksum (fletcher32) is never worth skipping, so
    a skipped one of those means the chunk was written by something else."""
    from h5py import h5z

    out = []
    for i in range(dcpl.get_nfilters()):
        code, flags = dcpl.get_filter(i)[:2]
        name = _FILTER_NAMES.get(code, f"filter {code}")
        optional = bool(flags & h5z.FLAG_OPTIONAL) and code != h5z.FILTER_FLETCHER32
        out.append((name, optional))
    return out


def _bad_skips(mask: int, pipeline: list[tuple[str, bool]]) -> list[str]:
    """Names of the filters ``mask`` skips although they may not be skipped (bits past the end
    of the pipeline name filters that do not exist)."""
    bad = []
    for bit in range(32):
        if mask >> bit & 1:
            if bit >= len(pipeline):
                bad.append(f"filter #{bit}, which the dataset does not have")
            elif not pipeline[bit][1]:
                bad.append(pipeline[bit][0])
    return bad


_FILTER_NAMES = {1: "deflate", 2: "shuffle", 3: "fletcher32", 4: "szip", 5: "nbit",
                 6: "scaleoffset", 32000: "lzf", 32001: "blosc"}


def _zarr_structure(reader: Any, info: Any) -> list[tuple[tuple[int, ...] | None, str]]:
    from ..stores.zarr.checks import codec_names

    array = reader._array(info.node)
    _outer, inner = codec_names(array.metadata)
    problems: list[tuple[tuple[int, ...] | None, str]] = []
    if "Crc32cCodec" not in inner:
        problems.append((None, "no per-chunk checksum (crc32c codec missing)"))
    sharding = [c for c in array.metadata.codecs if type(c).__name__ == "ShardingCodec"]
    tree = getattr(reader, "_tree", None)
    if sharding and tree is not None and math.prod(array.shape):
        problems.extend(_shard_index_problems(reader, info.node, array, sharding[0], tree.root))
    return problems


def _shard_index_problems(
    reader: Any, node: str, array: Any, shard: Any, root: Path
) -> list[tuple[tuple[int, ...] | None, str]]:
    """Read each shard's index (at its end, crc32c-protected) and report empty or
    out-of-range slots for inner chunks that overlap the array."""
    from ..stores.zarr.checks import zarr_chunk_keys, zarr_grid
    from ..stores.zarr.compat import plain_codecs, sharding_document

    config = sharding_document(array) or {}
    if not plain_codecs(config.get("index_codecs") or []) \
            or config.get("index_location", "end") != "end":
        return []
    shard_shape = zarr_grid(node, array)
    inner = tuple(int(c) for c in config["chunk_shape"])
    per_shard = tuple(s // c for s, c in zip(shard_shape, inner))
    n_slots = math.prod(per_shard)
    index_bytes = 16 * n_slots + 4
    problems: list[tuple[tuple[int, ...] | None, str]] = []
    for key, coords in zarr_chunk_keys(node, array, len(reader._tree.files)):
        path = root / key
        size = path.stat().st_size
        if size < index_bytes:
            problems.append((None, f"shard {key!r} is shorter than its index"))
            continue
        with path.open("rb") as f:
            f.seek(size - index_bytes)
            raw = f.read(index_bytes)
        body, stored = raw[:-4], int.from_bytes(raw[-4:], "little")
        if google_crc32c.value(body) != stored:
            problems.append((None, f"shard {key!r}: index checksum mismatch"))
            continue
        table = np.frombuffer(body, dtype="<u8").reshape(n_slots, 2)
        for slot, (offset, nbytes) in enumerate(table):
            local = np.unravel_index(slot, per_shard)
            chunk = tuple(int(s * p + q) for s, p, q in zip(coords, per_shard, local))
            if any(c * n >= d for c, n, d in zip(chunk, inner, array.shape)):
                continue  # slot beyond the array's edge: legitimately empty
            if int(offset) == _EMPTY and int(nbytes) == _EMPTY:
                problems.append((chunk, f"missing from shard {key!r} (would read as fill)"))
            elif int(offset) + int(nbytes) > size - index_bytes:
                problems.append((chunk, f"lies outside shard {key!r}"))
    return problems


__all__ = ["Problem", "VerifyReport", "verify"]

if __name__ == "__main__":
    sys.exit(_main())
