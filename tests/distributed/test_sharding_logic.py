"""Pure shard logic: exact cover, overlaps, gaps, replica owners, resharding reads, zarr chunk
alignment and the parsing of recorded shards. No torch, no processes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lean_store.distributed.plan import make_plan
from lean_store.distributed.shard_spec import (
    Box,
    ShardSpec,
    aligned_chunks,
    assign_owners,
    boundary_grain,
    check_coverage,
    coverage_problems,
    first_gap,
    is_aligned,
    reads_for,
)
from lean_store.distributed.sharded_read import parse_shards
from lean_store.errors import CheckpointError, IntegrityError, LayoutError


def torch_chunks(dim: int, n: int) -> list[tuple[int, int]]:
    """(offset, length) of each rank for Shard on a dim of ``dim`` over ``n`` ranks, as torch
    splits it (ceil-sized pieces, trailing ones possibly empty)."""
    size = -(-dim // n)
    return [(min(r * size, dim), max(0, min(dim, (r + 1) * size) - min(r * size, dim)))
            for r in range(n)]


def shard_boxes(shape: tuple[int, ...], axis: int, n: int) -> list[Box]:
    out = []
    for off, length in torch_chunks(shape[axis], n):
        offsets = [0] * len(shape)
        lengths = list(shape)
        offsets[axis], lengths[axis] = off, length
        out.append(Box(tuple(offsets), tuple(lengths)))
    return out


def test_box_math():
    a = Box((0, 2), (4, 3))
    b = Box((2, 0), (4, 4))
    assert a.intersect(b) == Box((2, 2), (2, 2))
    assert a.intersect(Box((4, 0), (1, 5))) is None
    assert a.region() == (slice(0, 4), slice(2, 5))
    assert b.local((slice(3, 5), slice(1, 2))) == (slice(1, 3), slice(1, 2))
    assert str(a) == "[0:4, 2:5]"
    with pytest.raises(CheckpointError, match="does not fit"):
        ShardSpec.of((4, 4), (2, 0), (3, 4))


@pytest.mark.parametrize("shape,axis,n", [((10, 6), 0, 4), ((10, 6), 1, 4), ((7,), 0, 3),
                                          ((3, 5, 2), 2, 4), ((1,), 0, 4)])
def test_torch_style_splits_cover_exactly(shape, axis, n):
    boxes = shard_boxes(shape, axis, n)
    assert coverage_problems(shape, boxes, "t") == []
    check_coverage(shape, boxes, "t")


def test_overlap_is_reported_with_its_block():
    problems = coverage_problems((8, 4), [Box((0, 0), (5, 4)), Box((4, 0), (4, 4))], "tensor 'w'")
    assert problems == ["tensor 'w': shards [0:5, 0:4] and [4:8, 0:4] overlap in [4:5, 0:4]"]


def test_gap_is_reported_with_count_and_place():
    problems = coverage_problems((8, 4), [Box((0, 0), (3, 4)), Box((5, 0), (3, 4))], "t")
    assert len(problems) == 1
    assert "8 are missing" in problems[0] and "[3:5, 0:4]" in problems[0]
    with pytest.raises(CheckpointError, match="exactly once"):
        check_coverage((8, 4), [Box((0, 0), (3, 4))], "t")


def test_overlap_hidden_by_equal_volume_is_still_found():
    # volumes add up to the total, but one block is covered twice and another not at all
    boxes = [Box((0, 0), (2, 4)), Box((1, 0), (2, 4)), Box((3, 0), (0, 4))]
    problems = coverage_problems((4, 4), boxes + [Box((0, 0), (0, 0))], "t")
    assert any("overlap" in p for p in problems)


def test_out_of_bounds_and_empty_boxes():
    assert "outside" in coverage_problems((4,), [Box((2,), (3,))], "t")[0]
    assert coverage_problems((4,), [Box((0,), (4,)), Box((4,), (0,))], "t") == []
    assert coverage_problems((0, 3), [], "t") == []
    assert first_gap((4,), [Box((0,), (4,))]) is None


def test_replicas_are_owned_by_lowest_rank_and_partial_overlap_is_an_error():
    whole = Box((0,), (6,))
    assert assign_owners((6,), [[whole], [whole], [whole]], "t") == [(whole, 0)]
    halves = [[Box((0,), (3,))], [Box((3,), (3,))], [Box((0,), (3,))], [Box((3,), (3,))]]
    assert assign_owners((6,), halves, "t") == [(Box((0,), (3,)), 0), (Box((3,), (3,)), 1)]
    with pytest.raises(CheckpointError, match="overlap"):
        assign_owners((6,), [[Box((0,), (4,))], [Box((3,), (3,))]], "t")


def test_resharding_reads_are_the_exact_cover_of_the_target():
    shape = (10, 6)
    stored = shard_boxes(shape, 0, 4)  # Shard(0) on 4 ranks
    for target in shard_boxes(shape, 1, 2):  # Shard(1) on 2 ranks
        reads = reads_for(target, stored)
        assert len(reads) == 4  # one block from every stored shard, nothing more
        shifted = [Box(tuple(o - t for o, t in zip(r.offsets, target.offsets)), r.lengths)
                   for r in reads]
        assert coverage_problems(target.lengths, shifted, "target") == []
    assert reads_for(Box((0, 0), (3, 6)), stored) == [Box((0, 0), (3, 6))]


def test_grain_is_gcd_of_interior_boundaries():
    assert boundary_grain((10, 8), shard_boxes((10, 8), 0, 4)) == (3, 8)
    assert boundary_grain((12,), [Box((0,), (4,)), Box((4,), (4,)), Box((8,), (4,))]) == (4,)
    assert boundary_grain((7,), [Box((0,), (7,))]) == (7,)


def test_aligned_chunks_divide_every_boundary_and_respect_the_budget():
    shape = (1024, 1024)
    plan = aligned_chunks(shape, shard_boxes(shape, 1, 4), 4, 1 << 20)
    assert plan.aligned and plan.chunks == (1024, 256)
    plan = aligned_chunks(shape, shard_boxes(shape, 1, 4), 4, 64 << 10)
    assert plan.aligned and plan.chunks == (64, 256)
    plan = aligned_chunks((10, 8), shard_boxes((10, 8), 0, 4), 4, 1 << 20)
    assert plan == plan.__class__((3, 8), True)


def test_misaligned_shards_fall_back_to_ordinary_chunks():
    # boundaries 5 and 7 have gcd 1: aligned chunks would be single elements
    shape = (100_000,)
    boxes = [Box((0,), (5,)), Box((5,), (2,)), Box((7,), (99_993,))]
    plan = aligned_chunks(shape, boxes, 4, 1 << 20)
    assert not plan.aligned
    assert not is_aligned(shape, boxes, plan.chunks)
    assert math.prod(plan.chunks) * 4 <= 1 << 20


@settings(max_examples=60, deadline=None)
@given(
    dims=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    axis_seed=st.integers(0, 10),
    n=st.integers(1, 5),
    chunk_bytes=st.sampled_from([1024, 4096, 1 << 20]),
)
def test_aligned_plans_never_straddle_shards(dims, axis_seed, n, chunk_bytes):
    shape = tuple(dims)
    axis = axis_seed % len(shape)
    boxes = shard_boxes(shape, axis, n)
    plan = aligned_chunks(shape, boxes, 4, chunk_bytes)
    if plan.aligned:
        assert is_aligned(shape, boxes, plan.chunks)
        # every chunk lies in exactly one shard
        owner = np.full(shape, -1)
        for i, b in enumerate(boxes):
            owner[b.region()] = i
        grid = [range(0, d, c) for d, c in zip(shape, plan.chunks)]
        for corner in np.ndindex(*[len(g) for g in grid]):
            start = [g[i] for g, i in zip(grid, corner)]
            block = owner[tuple(slice(s, s + c) for s, c in zip(start, plan.chunks))]
            assert len(np.unique(block)) == 1
    assert all(1 <= c for c in plan.chunks)


def test_make_plan_rejects_ranks_with_different_states():
    a = {"layout": [{"name": "w", "shape": [4], "format": "float32"}], "boxes": [[[0], [2]]]}
    b = {"layout": [{"name": "w", "shape": [5], "format": "float32"}], "boxes": [[[2], [2]]]}
    with pytest.raises(LayoutError, match="rank 1 holds a different state"):
        make_plan([a, b])
    b = {"layout": a["layout"], "boxes": [[[1], [3]]]}
    with pytest.raises(CheckpointError, match="overlap"):
        make_plan([a, b])
    b = {"layout": a["layout"], "boxes": [[[2], [2]]]}
    layout, plans = make_plan([a, b])
    assert [(str(box), owner) for box, owner in plans[0].shards] == [("[0:2]", 0), ("[2:4]", 1)]


def test_parse_shards_checks_every_field():
    good = [{"offsets": [0, 0], "lengths": [2, 3], "rank": 0, "crc32c": 7, "unit": [1, 3]}]
    (shard,) = parse_shards("w", json.dumps(good), (2, 3))
    assert shard.box == Box((0, 0), (2, 3)) and shard.unit == (1, 3) and shard.crc32c == 7
    bad_items = [
        "not json",
        json.dumps({"offsets": [0]}),
        json.dumps([{**good[0], "offsets": [0]}]),
        json.dumps([{**good[0], "lengths": [2, -3]}]),
        json.dumps([{**good[0], "unit": [0, 3]}]),
        json.dumps([{**good[0], "rank": True}]),
        json.dumps([{**good[0], "crc32c": 2**32}]),
        json.dumps([1]),
    ]
    for text in bad_items:
        with pytest.raises(IntegrityError):
            parse_shards("w", text, (2, 3))
