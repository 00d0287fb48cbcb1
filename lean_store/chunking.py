"""Chunk planning. Chunks are row blocks, so each one is a contiguous run of the tensor's bytes.

For a stored shape ``(d0, ..., dn)`` the planner picks the first axis ``k`` whose trailing
block ``d(k+1) * ... * dn`` fits in ``chunk_bytes``, and takes ``c`` indices of axis ``k``:
chunk = ``(1, ..., 1, c, d(k+1), ..., dn)``. Chunks in C order of the chunk grid therefore
concatenate to the tensor's bytes in C order, which lets a writer stream them and a digest be
computed in one pass.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterator, Sequence

DEFAULT_CHUNK_BYTES = 4 << 20
MIN_CHUNK_BYTES = 1 << 10

Region = tuple[slice, ...]


def plan_chunks(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> tuple[int, ...]:
    """Chunk shape for ``shape`` (rank >= 1) with at most about ``chunk_bytes`` per chunk."""
    if not shape:
        raise ValueError("stored shapes have rank >= 1")
    budget = max(1, chunk_bytes // max(1, itemsize))
    for k in range(len(shape)):
        trailing = math.prod(shape[k + 1 :])
        if trailing <= budget:
            count = max(1, min(shape[k], budget // max(1, trailing)))
            return (1,) * k + (max(1, count),) + tuple(max(1, d) for d in shape[k + 1 :])
    return (1,) * (len(shape) - 1) + (max(1, min(shape[-1], budget)),)  # pragma: no cover


def last_cut_axis(shape: Sequence[int], chunks: Sequence[int]) -> int | None:
    """The last axis whose chunk side is less than the array's (None: one chunk holds it
    all). For row-block chunks ``(1, ..., 1, c, d(k+1), ..., dn)`` that is the split axis
    ``k``, also when a leading 1 cuts the axes before it: ``(1, 256)`` of ``(600, 1000)``."""
    return next((i for i in reversed(range(len(shape))) if chunks[i] < shape[i]), None)


def grow_chunks(shape: tuple[int, ...], chunks: tuple[int, ...], factor: int) -> tuple[int, ...]:
    """A shard shape: ``chunks`` with its split axis grown ``factor`` times, kept a multiple.
    The split axis is the last one the chunks cut, so a shard is a row block too: ``(1, 256)``
    chunks of a ``(600, 1000)`` array (one row over the chunk budget) make ``(1, 1024)``
    shards, whose bytes are one contiguous run, not ``(8, 256)`` blocks of eight rows."""
    axis = last_cut_axis(shape, chunks)
    if axis is None:
        return chunks
    whole = math.ceil(shape[axis] / chunks[axis]) * chunks[axis]
    return chunks[:axis] + (min(chunks[axis] * factor, whole),) + chunks[axis + 1 :]


def iter_regions(shape: tuple[int, ...], unit: tuple[int, ...]) -> Iterator[Region]:
    """Regions of ``unit`` shape covering ``shape``, in C order, clipped at the edges."""
    if 0 in shape:
        return
    if all(map(operator.ge, unit, shape)):  # one region (most small tensors)
        yield tuple(map(slice, itertools.repeat(0), shape[: len(unit)]))
        return
    counts = [math.ceil(d / u) for d, u in zip(shape, unit)]
    for index in grid_indices(counts):
        yield tuple(slice(i * u, min((i + 1) * u, d)) for i, u, d in zip(index, unit, shape))


def grid_indices(counts: list[int]) -> Iterator[tuple[int, ...]]:
    """Every index of an N-d grid with ``counts`` cells per axis, in C order."""
    if any(n <= 0 for n in counts):
        return
    index = [0] * len(counts)
    while True:
        yield tuple(index)
        for axis in reversed(range(len(counts))):
            index[axis] += 1
            if index[axis] < counts[axis]:
                break
            index[axis] = 0
        else:
            return


def touched_cells(
    start: Sequence[int], count: Sequence[int], step: Sequence[int], cell: Sequence[int],
    shape: Sequence[int],
) -> Iterator[tuple[int, ...]]:
    """Grid coordinates, in C order, of every cell of shape ``cell`` (a chunk or shard) that
    the strided selection ``start/count/step`` touches in an array of ``shape``.

    The grid has the array's full rank. Axes past the selection's rank (the (re, im) axis of
    complex values stored as word pairs) are selected whole, so every coordinate has one
    entry per axis of the array; an empty selection touches nothing."""
    if len(cell) != len(shape) or len(start) > len(shape):
        raise ValueError(f"a grid of rank {len(cell)} for an array of rank {len(shape)}, "
                         f"selected over {len(start)} axes")
    rank = len(start)
    start = tuple(start) + (0,) * (len(shape) - rank)
    count = tuple(count) + tuple(shape[rank:])
    step = tuple(step) + (1,) * (len(shape) - rank)
    axes: list[Sequence[int]] = []
    for a, n, st, c in zip(start, count, step, cell):
        if n <= 0:
            return
        last = a + (n - 1) * st
        axes.append(range(a // c, last // c + 1) if st <= c
                    else sorted({(a + k * st) // c for k in range(n)}))
    yield from itertools.product(*axes)


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in region)


def grid_shape(shape: Sequence[int], chunks: Sequence[int]) -> tuple[int, ...]:
    """Chunks along each axis of the grid of ``shape`` cut into ``chunks``."""
    return tuple(-(-int(d) // int(c)) for d, c in zip(shape, chunks))


def chunk_number(coords: tuple[int, ...], grid: tuple[int, ...]) -> int:
    """Position of chunk ``coords`` in C order of the chunk grid."""
    n = 0
    for c, g in zip(coords, grid):
        n = n * g + c
    return n


def chunk_count(shape: Sequence[int], chunks: Sequence[int]) -> int:
    """Chunks in the grid of ``shape``; 0 for an empty array."""
    return math.prod(grid_shape(shape, chunks))


def splits_into_row_blocks(shape: tuple[int, ...], chunks: tuple[int, ...]) -> bool:
    """Blocks of ``chunks`` taken in C order concatenate to the array's bytes in C order:
    ones before the split axis, whole axes after it (one block covering all is one too)."""
    if len(chunks) != len(shape):
        return False
    split = next((i for i, (c, d) in enumerate(zip(chunks, shape)) if c < d), len(shape))
    if split == len(shape):  # one block covers the whole array
        return True
    return all(c == 1 for c in chunks[:split]) and all(
        c >= d for c, d in zip(chunks[split + 1 :], shape[split + 1 :])
    )
