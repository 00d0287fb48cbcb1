"""Per-tensor statistics, streamed block by block with bounded memory, decoded exactly.

Every format is decoded exactly (``Encoded`` formats through their codec) before anything is
computed. ``min``/``max``/``mean`` are over the finite values; NaN and infinities are counted
separately. Integer means are exact (the sum is kept as a Python integer); float means sum
each block pairwise in float64 and combine the block sums with ``math.fsum`` (a block whose sum
would overflow is summed scaled by an exact power of two, so huge finite values give a finite
mean).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..checkpoint import Checkpoint
from ..formats import BoolFormat, ComplexFormat, IntegerFormat
from ..layout import Entry
from .reading import DEFAULT_BLOCK_BYTES, decoder, iter_words

SCALE = 64  # block sums that overflow are taken of x * 2**-SCALE


@dataclass
class TensorStats:
    """Statistics of one tensor. Complex tensors have no min/max; their mean is complex."""

    name: str
    count: int = 0
    finite: int = 0
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    min: Any = None
    max: Any = None
    mean: Any = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("min", "max", "mean"):
            out[key] = _json_number(out[key])
        return out


def _json_number(value: Any) -> Any:
    if isinstance(value, complex):
        return {"re": _json_number(value.real), "im": _json_number(value.imag)}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class _Accumulator:
    def __init__(self, entry: Entry) -> None:
        self.entry = entry
        self.stats = TensorStats(entry.name)
        fmt = entry.format
        self.integral = isinstance(fmt, (IntegerFormat, BoolFormat))
        self.complex = isinstance(fmt, ComplexFormat)
        self.decode = decoder(fmt)
        self.int_sum = 0
        self.float_sums: list[float] = []
        self.scaled_sums: list[float] = []  # block sums that overflowed, taken of x * 2**-SCALE
        self.imag_sums: list[float] = []
        self.imag_scaled: list[float] = []

    def add(self, words: np.ndarray) -> None:
        values = self.decode(words).reshape(-1)
        s = self.stats
        s.count += values.size
        if values.size == 0:
            return
        if self.integral:
            self._add_integers(values)
            return
        if self.complex:
            re, im = values.real, values.imag
            nan = np.isnan(re) | np.isnan(im)
            inf = ~nan & (np.isinf(re) | np.isinf(im))
            s.nan += int(nan.sum())
            s.posinf += int(inf.sum())  # complex infinities have no sign: counted as posinf
            finite = values[~nan & ~inf]
            s.finite += finite.size
            if finite.size:
                self._add_sum(finite.real)
                self._add_sum(finite.imag, imag=True)
            return
        nan = np.isnan(values)
        s.nan += int(nan.sum())
        s.posinf += int(np.count_nonzero(values == np.inf))
        s.neginf += int(np.count_nonzero(values == -np.inf))
        finite = values[np.isfinite(values)]
        s.finite += finite.size
        if finite.size:
            lo, hi = float(finite.min()), float(finite.max())
            s.min = lo if s.min is None else min(s.min, lo)
            s.max = hi if s.max is None else max(s.max, hi)
            self._add_sum(finite)

    def _add_sum(self, finite: np.ndarray, imag: bool = False) -> None:
        sums, scaled = (self.imag_sums, self.imag_scaled) if imag else (
            self.float_sums, self.scaled_sums)
        with np.errstate(over="ignore"):
            total = float(finite.sum())
        if math.isfinite(total):
            sums.append(total)
        else:  # finite values whose float64 sum overflows: sum them scaled (exact powers of 2)
            scaled.append(float((finite * 2.0**-SCALE).sum()))

    def _mean(self, sums: list[float], scaled: list[float]) -> float:
        n = self.stats.finite
        return math.fsum(sums) / n + (math.fsum(scaled) / n) * 2.0**SCALE

    def _add_integers(self, values: np.ndarray) -> None:
        s = self.stats
        s.finite += values.size
        lo, hi = int(values.min()), int(values.max())
        s.min = lo if s.min is None else min(s.min, lo)
        s.max = hi if s.max is None else max(s.max, hi)
        if values.dtype == np.bool_:
            self.int_sum += int(np.count_nonzero(values))
        elif values.dtype.itemsize < 8:
            self.int_sum += int(values.sum(dtype=np.int64))
        else:  # split 64-bit words so that no partial sum can overflow
            wide = values.view(np.uint64) if values.dtype.kind == "u" else values
            high = (wide >> 32).astype(np.int64)
            low = (wide & 0xFFFFFFFF).astype(np.int64)
            self.int_sum += (int(high.sum()) << 32) + int(low.sum())

    def finish(self) -> TensorStats:
        s = self.stats
        if s.finite:
            if self.integral:
                s.mean = self.int_sum / s.finite  # Python int / int: correctly rounded
            elif self.complex:
                s.mean = complex(self._mean(self.float_sums, self.scaled_sums),
                                 self._mean(self.imag_sums, self.imag_scaled))
            else:
                s.mean = self._mean(self.float_sums, self.scaled_sums)
        return s


def tensor_stats(
    ck: Checkpoint, name: str, *, block_bytes: int = DEFAULT_BLOCK_BYTES, progress: Any = None
) -> TensorStats:
    """Statistics of one tensor, reading it block by block (its digest is verified)."""
    entry = ck.layout[name]
    acc = _Accumulator(entry)
    for _, words in iter_words(ck, entry, block_bytes):
        acc.add(words)
        if progress is not None:
            progress.advance(words.nbytes)
    return acc.finish()


__all__ = ["TensorStats", "tensor_stats"]
