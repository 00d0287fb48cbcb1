"""Box.intersect (rewritten as one loop for the sharded load's sake) agrees with the
definition: the common block of two boxes, None when they share no element."""

from __future__ import annotations

import itertools

import numpy as np

from lean_store.distributed.shard_spec import Box


def _by_definition(a: Box, b: Box, shape: tuple[int, ...]) -> set[tuple[int, ...]]:
    def cells(box: Box) -> set[tuple[int, ...]]:
        return set(itertools.product(*(range(o, o + n) for o, n in zip(box.offsets,
                                                                       box.lengths))))
    del shape
    return cells(a) & cells(b)


def test_intersect_is_the_common_block() -> None:
    rng = np.random.default_rng(7)
    shape = (6, 5)
    for _ in range(400):
        boxes = []
        for _ in range(2):
            offsets = tuple(int(rng.integers(0, d)) for d in shape)
            lengths = tuple(int(rng.integers(0, d - o + 1)) for o, d in zip(offsets, shape))
            boxes.append(Box(offsets, lengths))
        a, b = boxes
        common = _by_definition(a, b, shape)
        got = a.intersect(b)
        if not common:
            assert got is None
        else:
            assert got is not None and _by_definition(got, got, shape) == common
            assert got == b.intersect(a)


def test_intersect_of_scalars_and_equal_boxes() -> None:
    one = Box((0,), (1,))
    assert one.intersect(one) == one
    assert Box((), ()).intersect(Box((), ())) == Box((), ())
    assert Box((0, 0), (0, 3)).intersect(Box((0, 0), (2, 3))) is None
