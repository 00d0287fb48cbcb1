"""numpy basic indexing (ints, slices with any step, ``...``) turned into strided boxes."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import CheckpointError
from .stores.base import Selection


@dataclass(frozen=True)
class BasicIndex:
    """An ascending selection to read, then axes to flip and axes to drop."""

    selection: Selection
    flip: tuple[int, ...]
    drop: tuple[int, ...]

    def finish(self, data: np.ndarray, pair_axis: bool) -> np.ndarray:
        """Apply flips and drop integer-indexed axes on the words read."""
        if self.flip:
            key = [slice(None)] * data.ndim
            for axis in self.flip:
                key[axis] = slice(None, None, -1)
            data = data[tuple(key)]
        if self.drop:
            data = data.reshape(
                tuple(n for i, n in enumerate(self.selection.count) if i not in self.drop)
                + ((2,) if pair_axis else ())
            )
        return data if data.flags.c_contiguous else data.copy()


def basic_index(key: Any, shape: tuple[int, ...]) -> BasicIndex:
    """Normalize ``key`` for ``shape``; rank-0 shapes are read as stored shape ``(1,)``."""
    if not isinstance(key, tuple):
        key = (key,)
    ellipses = [i for i, k in enumerate(key) if k is Ellipsis]  # by identity: no array ==
    if len(ellipses) > 1:
        raise CheckpointError("an index can only have a single ellipsis ('...')")
    if ellipses:
        at = ellipses[0]
        fill = len(shape) - (len(key) - 1)
        key = key[:at] + (slice(None),) * max(0, fill) + key[at + 1 :]
    if len(key) > len(shape):
        raise CheckpointError(f"too many indices ({len(key)}) for a tensor of rank {len(shape)}")
    key = key + (slice(None),) * (len(shape) - len(key))
    start, count, step, flip, drop = [], [], [], [], []
    for axis, (k, n) in enumerate(zip(key, shape)):
        if isinstance(k, slice):
            try:
                r = range(n)[k]
            except (ValueError, TypeError) as exc:  # a step of 0, bounds that are not ints
                raise CheckpointError(f"unsupported slice {k!r}: {exc}") from None
            if r.step < 0:
                r = r[::-1]
                flip.append(axis)
            start.append(r.start if len(r) else 0)
            count.append(len(r))
            step.append(r.step)
        else:
            try:
                i = operator.index(k)
            except TypeError:
                raise CheckpointError(
                    f"unsupported index {k!r}: use ints, slices and '...' (basic indexing)"
                ) from None
            if not -n <= i < n:
                raise CheckpointError(f"index {i} is out of bounds for axis {axis} with size {n}")
            start.append(i % n)
            count.append(1)
            step.append(1)
            drop.append(axis)
    if not shape:  # scalars are stored as (1,)
        return BasicIndex(Selection((0,), (1,), (1,)), (), (0,))
    return BasicIndex(Selection(tuple(start), tuple(count), tuple(step)), tuple(flip), tuple(drop))
