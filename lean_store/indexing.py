"""numpy basic indexing (ints, slices with any step, ``...``, ``None``) turned into strided
boxes."""

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
    insert: tuple[int, ...] = ()  # new axes (``None``), positions in the result

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
        if self.insert:
            data = np.expand_dims(data, self.insert)
        return data if data.flags.c_contiguous else data.copy()


def basic_index(key: Any, shape: tuple[int, ...]) -> BasicIndex:
    """Normalize ``key`` for ``shape``; rank-0 shapes are read as stored shape ``(1,)``."""
    if not isinstance(key, tuple):
        key = (key,)
    for k in key:
        if isinstance(k, (bool, np.bool_)) or "bool" in str(getattr(k, "dtype", "")):
            raise CheckpointError(
                f"unsupported index {k!r}: a boolean selects with a mask in numpy, not an "
                "element; use ints, slices, '...' and None (basic indexing)")
    ellipses = [i for i, k in enumerate(key) if k is Ellipsis]  # by identity: no array ==
    if len(ellipses) > 1:
        raise CheckpointError("an index can only have a single ellipsis ('...')")
    news = sum(1 for k in key if k is None)
    if ellipses:
        at = ellipses[0]
        fill = len(shape) - (len(key) - 1 - news)
        key = key[:at] + (slice(None),) * max(0, fill) + key[at + 1 :]
    if len(key) - news > len(shape):
        raise CheckpointError(
            f"too many indices ({len(key) - news}) for a tensor of rank {len(shape)}")
    key = key + (slice(None),) * (len(shape) - (len(key) - news))
    insert, out_axis = [], 0  # where each None puts a new axis among the result's axes
    for k in key:
        if k is None:
            insert.append(out_axis)
            out_axis += 1
        elif isinstance(k, slice):
            out_axis += 1
    key = tuple(k for k in key if k is not None)
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
                    f"unsupported index {k!r}: use ints, slices, '...' and None (basic "
                    "indexing)"
                ) from None
            if not -n <= i < n:
                raise CheckpointError(f"index {i} is out of bounds for axis {axis} with size {n}")
            start.append(i % n)
            count.append(1)
            step.append(1)
            drop.append(axis)
    if not shape:  # scalars are stored as (1,)
        return BasicIndex(Selection((0,), (1,), (1,)), (), (0,), tuple(insert))
    return BasicIndex(Selection(tuple(start), tuple(count), tuple(step)), tuple(flip), tuple(drop),
                      tuple(insert))
