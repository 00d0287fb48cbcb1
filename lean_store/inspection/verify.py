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
import os
import subprocess
import sys
from dataclasses import dataclass, field

from ..checkpoint import Checkpoint
from ..chunking import Region, splits_into_row_blocks
from ..errors import CheckpointError, IntegrityError, listing
from ..layout import Entry, stored_rank_shape

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


def _verify_tensor(ck: Checkpoint, entry: Entry, report: VerifyReport) -> None:
    """Every chunk of ``entry`` read on its own through :meth:`Checkpoint.blocks`, each failure
    reported and the stream continued; then the digest. A sharded tensor: shard by shard, one
    problem per bad shard, naming its box and writer rank."""
    name = entry.name
    shards = ck.shards(name)
    if shards:  # saved by lean_store.distributed: one digest per shard
        for k, shard in enumerate(shards):
            try:
                for _region, words in ck.blocks(name, shard=k, reuse=True):
                    report.chunks += 1
                    report.nbytes += words.nbytes
            except CheckpointError as exc:
                report.problems.append(
                    Problem(name, None, f"shard {shard.box} (rank {shard.rank}): {exc}"))
        return
    for chunk, message in ck.structure_problems(name):
        report.problems.append(Problem(name, chunk, message))
    shape = stored_rank_shape(entry)
    chunks = ck.stored(name).chunk_shape[: len(shape)]
    by_chunk = splits_into_row_blocks(shape, chunks)  # else row blocks of the default size

    def failed(region: Region | None, exc: CheckpointError) -> None:
        if region is None:
            report.problems.append(Problem(name, None, f"{exc}; every chunk passed its own "
                                           "checksum, so chunks are swapped, stale or forged"))
            return
        report.chunks += 1
        coords = tuple(s.start // c for s, c in zip(region, chunks)) if by_chunk else None
        report.problems.append(Problem(name, coords, _chunk_message(exc, region)))

    for _region, words in ck.blocks(name, unit=chunks if by_chunk else None, reuse=True,
                                    on_error=failed):
        report.chunks += 1
        report.nbytes += words.nbytes


def _chunk_message(exc: Exception, region: Region) -> str:
    box = ", ".join(f"{s.start}:{s.stop}" for s in region)
    return f"elements [{box}] unreadable: {exc}"


__all__ = ["Problem", "VerifyReport", "verify"]

if __name__ == "__main__":
    sys.exit(_main())
