"""Source and target protocols: raw words in, raw words out, region by region."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..chunking import Region
from ..layout import Entry, Layout


class SourceTensor(ABC):
    """One tensor to save. ``read`` returns the raw words of a region of the stored shape
    (``shape`` or ``(1,)`` for scalars; complex formats add a trailing axis of 2). For CPU
    memory that is already contiguous the result is a zero-copy view."""

    device: str = "cpu"
    stage_engine: Any = None  # a lean_store.stream.CopyEngine for device memory, None on host
    stable_reads: bool = False
    """True when an array ``read`` returns stays unchanged until the save ends (a view of the
    tensor's own memory, or a fresh copy), so its unit may be written on a worker."""

    @abstractmethod
    def read(self, region: Region) -> np.ndarray: ...


class TensorSource(ABC):
    """An ordered set of tensors with their :class:`Layout`."""

    layout: Layout

    @abstractmethod
    def tensors(self) -> Iterator[tuple[Entry, SourceTensor]]: ...


class TargetTensor(ABC):
    """One tensor to load into, in place."""

    entry: Entry
    gave_memory: bool = False
    """True once the load gave the target's tensor memory (a module's meta tensor)."""
    takes_stored_entry: bool = False
    """True when the target loads the stored tensor whatever its shape and format (a module's
    extra state, handed to the module as saved): :meth:`adopt` the stored entry before the
    layout is checked."""

    @abstractmethod
    def write(self, region: Region, bits: np.ndarray) -> None:
        """Store raw words (the target's own format) into ``region`` of the stored shape."""

    def adopt(self, entry: Entry) -> None:
        """Take the stored ``entry``'s shape and format (only if :attr:`takes_stored_entry`)."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Called once the checkpoint is validated and checked, before any target is written:
        a target that must first change the object it loads into (a meta tensor given
        memory) does it here, and :meth:`undo` reverts it."""
        return None

    def undo(self) -> None:
        """Revert :meth:`prepare` (another target's preparation failed)."""
        return None

    def finish(self) -> None:
        """Called once every tensor of the load is installed (nothing to do for memory that
        was written in place)."""
        return None

    def memory(self) -> tuple[Any, ...] | None:
        """Where the target's words are (address, shape, byte strides, format and device):
        equal for two names of one tensor (tied weights); None where not known or empty."""
        return None


EXACT_OVERLAP_ELEMENTS = 1 << 22
"""A view whose strides alone cannot rule out overlap has its element offsets compared one by
one up to this many elements (32 MiB of offsets); a larger one is taken as overlapping."""


def elements_overlap(shape: Sequence[int], byte_strides: Sequence[int], itemsize: int) -> bool:
    """True when two elements of a strided view (``shape``, strides in bytes, any sign) may lie
    in the same memory: an ``expand()``ed or broadcast view (a stride of 0), an overlapping
    ``as_strided`` view. Such a view cannot hold a checkpoint's values: of the elements that
    share memory, the last one written wins."""
    if 0 in shape:
        return False
    reach = 0  # the farthest byte offset the dimensions of smaller strides reach
    for stride, n in sorted((abs(s), n) for n, s in zip(shape, byte_strides) if n > 1):
        if stride < reach + itemsize:
            break
        reach += stride * (n - 1)
    else:
        return False
    if math.prod(shape) > EXACT_OVERLAP_ELEMENTS:
        return True
    offsets = np.zeros(1, dtype=np.int64)
    for n, stride in zip(shape, byte_strides):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * stride).ravel()
    offsets.sort()
    return bool((np.diff(offsets) < itemsize).any())


def overlap_refusal(name: str) -> str:
    """Why a load into an overlapping view of ``name`` is refused, and what to do instead."""
    return (f"cannot load tensor {name!r} into a view whose elements share memory (an "
            "expand()ed or broadcast view, an overlapping as_strided view): it cannot hold the "
            "checkpoint's values; load into a tensor of its own (view.clone())")


def tied_to_stored(targets: Mapping[str, TargetTensor], stored: Layout, prefix: str = ""
                   ) -> dict[str, str]:
    """Targets the checkpoint lacks whose memory is that of a target it holds (tied weights:
    ``lm_head.weight`` is ``embed.weight``, and a Hugging Face safetensors file keeps one of
    them): name -> the stored twin, which loads both."""
    missing = {name: target.memory() for name, target in targets.items()
               if prefix + name not in stored}  # usually none: then no memory is looked at
    wanted = {key for key in missing.values() if key is not None}
    if not wanted:
        return {}
    held: dict[tuple[Any, ...], str] = {}
    for name, target in targets.items():
        if name not in missing:
            key = target.memory()
            if key in wanted:
                held.setdefault(key, name)
    return {name: held[key] for name, key in missing.items() if key in held}


def prepare_targets(targets: Iterable[TargetTensor]) -> None:
    """:meth:`TargetTensor.prepare` each of ``targets``; if one fails, those prepared are
    undone (in reverse) and the error raised: all or nothing, before any words are written."""
    done: list[TargetTensor] = []
    try:
        for target in targets:
            target.prepare()
            done.append(target)
    except BaseException:
        for target in reversed(done):
            target.undo()
        raise


@contextmanager
def prepared(targets: Iterable[TargetTensor], written: Callable[[], bool]) -> Iterator[None]:
    """:func:`prepare_targets` for the block, undone if the block fails before ``written()``
    (words were copied into a target)."""
    chosen = list(targets)
    prepare_targets(chosen)
    try:
        yield
    except BaseException:
        if not written():
            for target in reversed(chosen):
                target.undo()
        raise


def fitted_to_stored(targets: Mapping[str, TargetTensor], stored: Layout, prefix: str = ""
                     ) -> tuple[dict[str, TargetTensor], dict[str, str]]:
    """``targets`` fitted to the checkpoint's layout ``stored`` (names ``prefix`` + name):
    those that take their stored entry adopt it (a module's extra state, a lazy parameter),
    and those the checkpoint holds through a tied twin are left out. Returns the targets to
    load and the tied ones (name -> twin)."""
    adopt_stored(targets, stored, prefix)
    tied = tied_to_stored(targets, stored, prefix)
    return {n: t for n, t in targets.items() if n not in tied}, tied


def adopt_stored(targets: Mapping[str, TargetTensor], stored: Layout, prefix: str = "") -> None:
    """Each target that takes its stored entry adopts it, where ``stored`` has its name
    (``prefix`` + name: a training checkpoint's ``model/``)."""
    for name, target in targets.items():
        if target.takes_stored_entry and prefix + name in stored:
            target.adopt(stored[prefix + name])
