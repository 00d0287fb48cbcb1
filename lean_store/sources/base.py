"""Source and target protocols: raw words in, raw words out, region by region."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
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

    @abstractmethod
    def write(self, region: Region, bits: np.ndarray) -> None:
        """Store raw words (the target's own format) into ``region`` of the stored shape."""
