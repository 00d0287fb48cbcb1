"""``ShardedLayout``: how a backend lays out a checkpoint that many ranks write at once.

The distributed layer (``distributed/sharded_save.py``) and the DCP storage writer plan the
shards and run the collectives; each backend's record holds one of these and decides where the
shards go: HDF5 writes one shard file per rank and a master file of virtual datasets, Zarr writes
every rank's chunks into one array per tensor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from ..chunking import iter_regions
from ..distributed.plan import TensorPlan
from ..distributed.shard_spec import Box, ChunkPlan
from ..integrity import crc32c_update


def write_box(read: Callable[[tuple[slice, ...]], np.ndarray], box: Box, unit: tuple[int, ...],
              write: Callable[[tuple[slice, ...], np.ndarray], Any]) -> int:
    """Stream ``box`` of a rank's local tensor (``read(local_region)``) to
    ``write(global_region, bits)`` in units of ``unit`` (C order of the unit grid); returns the
    crc32c of the words in that order."""
    crc = 0
    for region in iter_regions(box.lengths, unit):
        bits = read(region)
        crc = crc32c_update(crc, bits)
        write(tuple(slice(s.start + o, s.stop + o) for s, o in zip(region, box.offsets)), bits)
    return crc


class RankShardWriter(ABC):
    """The shards one rank writes; a context manager that commits this rank's part on a clean
    exit."""

    @abstractmethod
    def write(self, plan: TensorPlan, chunk: ChunkPlan | None, k: int, box: Box,
              read: Callable[[tuple[slice, ...]], np.ndarray]) -> tuple[int, tuple[int, ...]]:
        """Write shard ``k`` (``box``) of ``plan``'s tensor; its crc32c and the unit it was
        computed in."""

    def __enter__(self) -> RankShardWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class ShardedLayout(ABC):
    """One backend's layout of a sharded checkpoint (stateless)."""

    checksum: str
    """The per-chunk checksum every shard is written with (the ``checksum`` option honoured)."""

    def check_target(self, path: Any) -> None:  # noqa: B027 - most targets are fine
        """Refuse a target this layout cannot write (before any rank writes)."""

    @abstractmethod
    def chunk_plans(self, plans: list[TensorPlan], chunk_bytes: int, *,
                    always_aligned: bool = False) -> list[ChunkPlan | None]:
        """Each tensor's chunking across ranks, or None where each rank chunks its own shard
        file. ``always_aligned``: never share a chunk between ranks."""

    def prepare(  # noqa: B027 - nothing to prepare by default
        self, work: str, plans: list[TensorPlan], chunks: list[ChunkPlan | None],
        compression: Any,
    ) -> None:
        """Rank 0, before any rank writes: what every rank's writes need (array metadata)."""

    @abstractmethod
    def rank_writer(self, work: str, rank: int, world: int, chunk_bytes: int,
                    compression: Any) -> RankShardWriter:
        """This rank's writer."""

    def write_metadata(  # noqa: B027 - most layouts write all metadata in finish
        self, work: str, world: int, plans: list[TensorPlan], chunk_bytes: int,
    ) -> None:
        """Rank 0, in the write stage after its own shards: the metadata that needs no digest
        (so the commit, which every rank waits for, does less)."""

    @abstractmethod
    def finish(self, work: str, world: int, plans: list[TensorPlan], records: list[str],
               root_attrs: dict[str, Any], chunk_bytes: int) -> None:
        """Rank 0, after every rank succeeded: shard records and root attributes, ``complete``
        last."""

    def abort(self) -> None:  # noqa: B027 - most layouts hold nothing open
        """The save failed: release what :meth:`write_metadata` kept open (the work directory
        is removed by the caller)."""
