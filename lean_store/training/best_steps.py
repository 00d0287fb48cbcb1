"""The best steps of a run by a metric its steps carry: what ``Checkpointer(keep_best=N,
metric=..., mode=...)`` keeps besides the last steps (Lightning's ``ModelCheckpoint(
save_top_k=N, monitor=...)``, Orbax's ``BestN``).

A step's metric is read from its training metadata (:func:`~lean_store.training.api.
training_info`: no tensor is read, nothing is changed) once, and remembered by the step's file
identity (a step saved again over the same name is a new file, read again). A step without the
metric (none in its ``extra``, not a finite number, or not a training checkpoint) is never among
the best.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .state import TrainingInfo

MODES = ("min", "max")


class BestSteps:
    """The ``keep`` best steps by ``metric`` (a key of the steps' ``extra``, or a function of
    their :class:`TrainingInfo`), lowest first with ``mode="min"``, highest with ``"max"``;
    of equal values, the later step."""

    def __init__(self, keep: Any, metric: Any, mode: Any) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise CheckpointError(f"keep_best must be a positive int or None, got {keep!r}")
        if not (isinstance(metric, str) and metric) and not callable(metric):
            raise CheckpointError(
                "keep_best needs metric=: the key of the steps' extra that ranks them (as "
                "save(..., extra={'val_loss': ...}) writes it), or a function of a step's "
                f"TrainingInfo; got {metric!r}")
        if mode not in MODES:
            raise CheckpointError(f"mode must be 'min' or 'max', got {mode!r}")
        self.keep = keep
        self.metric = metric
        self.mode = mode
        self._known: dict[tuple[str, int, int], float | None] = {}  # file identity -> value

    def of(self, entries: Mapping[int, Path], info: Callable[[Path], TrainingInfo]) -> set[int]:
        """The best steps among ``entries`` (step -> its path); ``info`` reads a step's
        metadata."""
        values = {}
        for step, path in entries.items():
            value = self._value(path, info)
            if value is not None:
                values[step] = value
        sign = 1.0 if self.mode == "min" else -1.0
        ranked = sorted(values, key=lambda s: (sign * values[s], -s))
        return set(ranked[: self.keep])

    def _value(self, path: Path, info: Callable[[Path], TrainingInfo]) -> float | None:
        try:
            status = os.stat(path)
        except OSError:
            return None  # gone meanwhile
        identity = (path.name, status.st_ino, status.st_mtime_ns)
        if identity not in self._known:
            try:
                found = info(path)
            except (CheckpointError, OSError):
                found = None  # damaged, unreadable, not a training checkpoint: not the best
            self._known[identity] = None if found is None else self._measure(found)
        return self._known[identity]

    def _measure(self, found: TrainingInfo) -> float | None:
        if callable(self.metric):
            try:
                value = self.metric(found)
            except Exception as exc:  # noqa: BLE001 - the user's function: named, not raw
                raise CheckpointError(
                    f"the metric function raised {type(exc).__name__}: {exc} (for step "
                    f"{found.step}, {found.path})") from exc
        else:
            extra = found.extra
            value = extra.get(self.metric) if isinstance(extra, dict) else None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return None
        value = float(value)
        return value if math.isfinite(value) else None


__all__ = ["MODES", "BestSteps"]
