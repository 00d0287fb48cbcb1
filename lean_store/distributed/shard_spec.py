"""Shard specs as pure logic: boxes of a global tensor, exact-cover checks, region math and
zarr chunk alignment. No torch, no I/O: every rank runs these on the same gathered inputs and
therefore reaches the same verdict.

A box is ``offsets`` + ``lengths`` in the tensor's *stored* shape (``shape`` or ``(1,)`` for a
scalar). A set of boxes covers a tensor when every element lies in exactly one box.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..chunking import Region, chunk_count, grid_indices
from ..errors import CheckpointError

CHUNKS_PER_SHARD = 16  # tiny aligned chunks are accepted up to this many per shard
MAX_GAP_CELLS = 1 << 20  # bound on the grid walked to name a gap; beyond it only counts are given


@dataclass(frozen=True, order=True)
class Box:
    """A rectangular block of a tensor: ``offsets[i] <= index[i] < offsets[i] + lengths[i]``."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, offsets: Sequence[int], lengths: Sequence[int]) -> Box:
        offsets = tuple(map(int, offsets))
        lengths = tuple(map(int, lengths))
        if len(offsets) != len(lengths):
            raise CheckpointError(f"shard offsets {offsets} and lengths {lengths} differ in rank")
        return cls(offsets, lengths)

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls(tuple(0 for _ in shape), tuple(int(d) for d in shape))

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths))

    @property
    def size(self) -> int:
        return math.prod(self.lengths)

    @property
    def empty(self) -> bool:
        return 0 in self.lengths

    def region(self) -> Region:
        """The box as a tuple of slices in global coordinates."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths))

    def local(self, region: Region) -> Region:
        """``region`` (global coordinates, inside this box) relative to this box's origin."""
        return tuple(slice(s.start - o, s.stop - o) for s, o in zip(region, self.offsets))

    def intersect(self, other: Box) -> Box | None:
        """The common block, or None when the boxes share no element. (One loop: a sharded
        load asks this thousands of times.)"""
        lo: list[int] = []
        lengths: list[int] = []
        for a, n, b, m in zip(self.offsets, self.lengths, other.offsets, other.lengths):
            start = a if a > b else b
            stop = min(a + n, b + m)
            if stop <= start:
                return None
            lo.append(start)
            lengths.append(stop - start)
        return Box(tuple(lo), tuple(lengths))

    def inside(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.offsets) and all(
            o >= 0 and n >= 0 and o + n <= d for o, n, d in zip(self.offsets, self.lengths, shape)
        )

    def to_json(self) -> dict[str, list[int]]:
        return {"offsets": list(self.offsets), "lengths": list(self.lengths)}

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.lengths)) + "]"


@dataclass(frozen=True)
class ShardSpec:
    """One rank's piece of a tensor: the global (logical) shape and this rank's box in it."""

    global_shape: tuple[int, ...]
    box: Box

    @classmethod
    def of(cls, global_shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]
           ) -> ShardSpec:
        shape = tuple(int(d) for d in global_shape)
        box = Box.of(offsets, lengths)
        if not box.inside(shape):
            raise CheckpointError(f"shard {box} does not fit in the global shape {shape}")
        return cls(shape, box)


def coverage_problems(shape: Sequence[int], boxes: Sequence[Box], what: str) -> list[str]:
    """Every reason why ``boxes`` do not cover ``shape`` exactly once (empty list: they do).

    Out-of-bounds boxes, each overlapping pair, and the uncovered element count with the first
    uncovered block are all reported, so one error can say everything that is wrong.
    """
    shape = tuple(shape)
    problems: list[str] = []
    live = []
    for box in boxes:
        if not box.inside(shape):
            problems.append(f"{what}: shard {box} lies outside the shape {list(shape)}")
        elif not box.empty:
            live.append(box)
    if problems:
        return problems
    ordered = sorted(live)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b.offsets[0] >= a.ends[0]:  # sorted by offsets: no later box meets ``a``
                break
            common = a.intersect(b)
            if common is not None:
                problems.append(f"{what}: shards {a} and {b} overlap in {common}")
    covered = sum(b.size for b in live)
    total = math.prod(shape)
    if not problems and covered != total:
        gap = first_gap(shape, live)
        where = f", e.g. {gap}" if gap is not None else ""
        problems.append(
            f"{what}: shards cover {covered} of {total} elements; "
            f"{total - covered} are missing{where}"
        )
    return problems


def first_gap(shape: Sequence[int], boxes: Sequence[Box]) -> Box | None:
    """One block no box covers, found on the grid of all box boundaries (None if too big)."""
    cuts = []
    for axis, dim in enumerate(shape):
        points = {0, dim}
        for b in boxes:
            points.update((b.offsets[axis], b.ends[axis]))
        cuts.append(sorted(p for p in points if 0 <= p <= dim))
    if math.prod(len(c) - 1 for c in cuts) > MAX_GAP_CELLS:
        return None
    for cell in _grid_cells(cuts):
        if not any(b.intersect(cell) is not None for b in boxes):
            return cell
    return None


def _grid_cells(cuts: list[list[int]]) -> Iterable[Box]:
    for index in grid_indices([len(c) - 1 for c in cuts]):
        yield Box(
            tuple(c[i] for c, i in zip(cuts, index)),
            tuple(c[i + 1] - c[i] for c, i in zip(cuts, index)),
        )


def check_coverage(shape: Sequence[int], boxes: Sequence[Box], what: str) -> None:
    """Raise one CheckpointError unless ``boxes`` cover ``shape`` exactly once."""
    problems = coverage_problems(shape, boxes, what)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise CheckpointError(f"shards do not cover the tensor exactly once:\n{lines}")


def assign_owners(
    shape: Sequence[int], held: Sequence[Sequence[Box]], what: str
) -> list[tuple[Box, int]]:
    """Deduplicate replicas: ``held[r]`` are rank r's boxes; each distinct box is owned by the
    lowest rank holding it. Returns ``(box, owner)`` sorted by offsets, after checking that the
    distinct boxes cover ``shape`` exactly once (partial overlaps are errors, not replicas)."""
    owners: dict[Box, int] = {}
    for rank, boxes in enumerate(held):
        for box in boxes:
            if not box.empty and box not in owners:
                owners[box] = rank
    distinct = sorted(owners)
    check_coverage(shape, distinct, what)
    return [(box, owners[box]) for box in distinct]


# ----------------------------------------------------------------------- resharding on load


def reads_for(target: Box, stored: Sequence[Box]) -> list[Box]:
    """The parts of ``target`` to read, one per stored box it meets (their exact cover)."""
    out = []
    for box in stored:
        common = target.intersect(box)
        if common is not None:
            out.append(common)
    return out


# --------------------------------------------------------------------------- zarr chunking


def boundary_grain(shape: Sequence[int], boxes: Sequence[Box]) -> tuple[int, ...]:
    """Per axis, the gcd of every interior shard boundary: the largest chunk length that never
    straddles two shards (the whole axis when no boundary falls inside it)."""
    grain = []
    for axis, dim in enumerate(shape):
        g = 0
        for b in boxes:
            for p in (b.offsets[axis], b.ends[axis]):
                if 0 < p < dim:
                    g = math.gcd(g, p)
        grain.append(g if g else max(1, dim))
    return tuple(grain)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    if limit >= n:
        return n
    best = 1
    i = 1
    while i * i <= n:
        if n % i == 0:
            for d in (i, n // i):
                if best < d <= limit:
                    best = d
        i += 1
    return best


@dataclass(frozen=True)
class ChunkPlan:
    """Chunk shape for a sharded tensor. ``aligned``: no chunk straddles two shards, so ranks
    write disjoint chunks concurrently; otherwise ranks must take turns (read-modify-write)."""

    chunks: tuple[int, ...]
    aligned: bool


def aligned_chunks(
    shape: Sequence[int], boxes: Sequence[Box], itemsize: int, chunk_bytes: int,
    min_chunk_bytes: int = 1024,
) -> ChunkPlan:
    """A chunk shape dividing every shard boundary, filled from the last axis, about
    ``chunk_bytes`` at most. When the shards force chunks below ``min_chunk_bytes`` and more
    than ``CHUNKS_PER_SHARD`` of them per shard, alignment is given up: the caller uses
    ordinary chunks and serialized writes (``aligned=False``) rather than a flood of tiny
    chunk files."""
    shape = tuple(int(d) for d in shape)
    grain = boundary_grain(shape, boxes)
    budget = max(1, chunk_bytes // max(1, itemsize))
    chunks = [1] * len(shape)
    room = budget
    for axis in reversed(range(len(shape))):
        chunks[axis] = _largest_divisor_at_most(grain[axis], max(1, room))
        room = max(1, room // chunks[axis])
    chunk = tuple(max(1, c) for c in chunks)
    assert is_aligned(shape, boxes, chunk)
    nbytes = math.prod(chunk) * itemsize
    n_chunks = chunk_count(shape, chunk)
    if nbytes < min_chunk_bytes and n_chunks > CHUNKS_PER_SHARD * max(1, len(boxes)):
        return ChunkPlan(_row_block(shape, budget), False)
    return ChunkPlan(chunk, True)


def _row_block(shape: tuple[int, ...], budget: int) -> tuple[int, ...]:
    from ..chunking import plan_chunks

    return plan_chunks(shape, 1, budget)


def is_aligned(shape: Sequence[int], boxes: Sequence[Box], chunks: Sequence[int]) -> bool:
    """True when every interior shard boundary is a multiple of the chunk length on its axis."""
    for axis, dim in enumerate(shape):
        for b in boxes:
            for p in (b.offsets[axis], b.ends[axis]):
                if 0 < p < dim and p % chunks[axis]:
                    return False
    return True


__all__ = [
    "Box", "ChunkPlan", "ShardSpec", "aligned_chunks", "assign_owners", "boundary_grain",
    "check_coverage", "coverage_problems", "first_gap", "is_aligned", "reads_for",
]
