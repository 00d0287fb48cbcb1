"""Source and target protocols: raw words in, raw words out, region by region."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
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

    def finish(self) -> None:
        """Called once every tensor of the load is installed (nothing to do for memory that
        was written in place)."""
        return None


def adopt_stored(targets: Mapping[str, TargetTensor], stored: Layout) -> None:
    """Each target that takes its stored entry adopts it, where ``stored`` has its name."""
    for name, target in targets.items():
        if target.takes_stored_entry and name in stored:
            target.adopt(stored[name])
