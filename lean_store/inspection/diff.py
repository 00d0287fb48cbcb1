"""Compare two checkpoints: layout differences, then per common tensor bit identity, the
largest absolute and relative differences and the largest ULP distance, streamed block by block.

Definitions (per element, over decoded exact values ``a`` and ``b``):

* equal values (including both NaN, or the same infinity) differ by 0;
* ``abs`` = ``|a - b|``; ``rel`` = ``|a - b| / max(|a|, |b|)``;
* a NaN against a non-NaN is counted in ``nan_mismatch`` and left out of abs/rel/ULP;
* ULP distance (same binary format only) is the number of representable values between the two
  bit patterns: patterns are mapped to a monotonic integer line (``-0`` and ``+0`` coincide).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..checkpoint import Checkpoint
from ..formats import BinaryFormat, ComplexFormat, ExponentFormat, ScalarFormat
from ..layout import Difference
from .foreign import InputBlocks
from .plain_data import metadata_diffs, plain_data
from .reading import DEFAULT_BLOCK_BYTES, block_unit, decoder, iter_words


@dataclass
class TensorDiff:
    """How one tensor present in both checkpoints compares."""

    name: str
    comparable: bool = True  # False when the shapes differ
    identical: bool = True  # the raw words are equal (and so are the formats)
    differing: int = 0  # elements whose words differ
    nan_mismatch: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    max_ulp: int | None = 0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("max_abs", "max_rel"):
            if isinstance(out[key], float) and not math.isfinite(out[key]):
                out[key] = str(out[key])
        return out


@dataclass
class DiffReport:
    """Everything :func:`diff` found."""

    layout: list[Difference] = field(default_factory=list)
    tensors: list[TensorDiff] = field(default_factory=list)
    metadata: list[str] = field(default_factory=list)  # plain data that differs, one a line

    @property
    def identical(self) -> bool:
        return (not self.layout and not self.metadata
                and all(t.identical for t in self.tensors))

    def to_json(self) -> dict[str, Any]:
        return {
            "identical": self.identical,
            "metadata": list(self.metadata),
            "layout": [
                {"kind": d.kind, "name": d.name, "expected": d.expected, "actual": d.actual,
                 "text": str(d)}
                for d in self.layout
            ],
            "tensors": [t.to_json() for t in self.tensors],
        }


def ordered_ints(words: np.ndarray, fmt: ScalarFormat) -> np.ndarray:
    """Map float bit patterns to int64 so that adjacent representable values differ by 1."""
    w = np.asarray(words, dtype=np.uint64)
    if isinstance(fmt, ExponentFormat):  # unsigned, exponent only: the words are ordered
        return w.astype(np.int64)
    sign = (w >> np.uint64(fmt.width - 1)) & np.uint64(1)
    magnitude = (w & np.uint64((1 << (fmt.width - 1)) - 1)).astype(np.int64)
    return np.where(sign == 1, -magnitude, magnitude)


def _value_diffs(result: TensorDiff, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Record abs/rel differences of unequal decoded values; return the mask of pairs kept."""
    if a.dtype.kind in "iub":
        wide = a.dtype.itemsize == 8 or b.dtype.itemsize == 8
        ia = a.astype(object) if wide else a.astype(np.int64)
        ib = b.astype(object) if wide else b.astype(np.int64)
        exact = np.abs(ia - ib)
        diff = exact.astype(np.float64)
        big = np.maximum(np.abs(a.astype(np.float64)), np.abs(b.astype(np.float64)))
        keep = np.ones(a.shape, dtype=bool)
        if result.max_ulp is not None and exact.size:
            result.max_ulp = max(result.max_ulp, int(exact.max()))
    else:
        a_nan, b_nan = np.isnan(a), np.isnan(b)
        result.nan_mismatch += int(np.count_nonzero(a_nan != b_nan))
        keep = ~a_nan & ~b_nan
        a, b = a[keep], b[keep]
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(a - b)
            diff = np.where(a == b, 0.0, diff)  # the same infinity
            diff = np.where(np.isnan(diff), np.inf, diff)  # opposite infinities
            big = np.maximum(np.abs(a), np.abs(b))
    if diff.size:
        result.max_abs = max(result.max_abs, float(diff.max()))
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = np.where(diff == 0, 0.0, diff / big)
        rel = np.where(np.isnan(rel), np.inf, rel)
        result.max_rel = max(result.max_rel, float(rel.max()))
    return keep


def _compare_block(
    result: TensorDiff, wa: np.ndarray, wb: np.ndarray, fa: ScalarFormat, fb: ScalarFormat,
    da: Any, db: Any,
) -> None:
    if fa == fb:
        neq = wa != wb
        if fa.words_per_value == 2:
            neq = neq.any(axis=-1)
        count = int(np.count_nonzero(neq))
        if count == 0:
            return
        result.identical = False
        result.differing += count
        sa, sb = wa[neq], wb[neq]
        keep = _value_diffs(result, da(sa), db(sb))
        if isinstance(fa, (BinaryFormat, ExponentFormat)) and result.max_ulp is not None:
            ua, ub = ordered_ints(sa[keep], fa), ordered_ints(sb[keep], fb)
            if ua.size:
                result.max_ulp = max(result.max_ulp, int(np.abs(ua - ub).max()))
        elif isinstance(fa, ComplexFormat):
            result.max_ulp = None
        return
    # Different formats: compare the decoded values.
    result.identical = False
    result.max_ulp = None
    a, b = da(wa).reshape(-1), db(wb).reshape(-1)
    with np.errstate(invalid="ignore"):
        same = (a == b) | (np.isnan(a) & np.isnan(b)) if a.dtype.kind in "fc" else a == b
    result.differing += int(np.count_nonzero(~same))
    _value_diffs(result, a[~same], b[~same])


def tensor_diff(
    a: Checkpoint | InputBlocks, b: Checkpoint | InputBlocks, name: str, *,
    block_bytes: int = DEFAULT_BLOCK_BYTES
) -> TensorDiff:
    """Compare tensor ``name`` of ``a`` and ``b`` block by block (both digests are verified)."""
    ea, eb = a.layout[name], b.layout[name]
    fa, fb = ea.format, eb.format
    if ea.shape != eb.shape or fa.words_per_value != fb.words_per_value:
        return TensorDiff(name, comparable=False, identical=False, max_ulp=None)
    result = TensorDiff(name)
    wide = ea if fa.storage_dtype.itemsize >= fb.storage_dtype.itemsize else eb
    unit = block_unit(wide, block_bytes)  # both sides read in blocks of the same shape
    da, db = decoder(fa), decoder(fb)
    blocks_b = iter_words(b, eb, unit=unit)
    for (_, wa), (_, wb) in zip(iter_words(a, ea, unit=unit), blocks_b):
        _compare_block(result, wa, wb, fa, fb, da, db)
    for _ in blocks_b:  # finish b's generator so that its digest is checked too
        pass
    if fa != fb:
        result.identical = False
    return result


def diff(a: Checkpoint | InputBlocks, b: Checkpoint | InputBlocks, *,
         block_bytes: int = DEFAULT_BLOCK_BYTES) -> DiffReport:
    """Compare checkpoint ``b`` against ``a`` (``a`` is the expected side of layout diffs);
    either may be a file of another format (:class:`.foreign.InputBlocks`)."""
    report = DiffReport(layout=b.layout.diff(a.layout),
                        metadata=metadata_diffs(plain_data(a), plain_data(b)))
    for entry in a.layout:
        if entry.name in b.layout:
            report.tensors.append(tensor_diff(a, b, entry.name, block_bytes=block_bytes))
    return report


__all__ = ["DiffReport", "TensorDiff", "diff", "ordered_ints", "tensor_diff"]
