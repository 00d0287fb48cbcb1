"""Reading a sharded checkpoint as whole tensors: the recorded shards of every tensor are
validated (well-formed, every element exactly once) when it is opened, and each shard's
crc32c digest is checked when it is read whole.

The digest of a shard is the crc32c of its raw words read in ``unit``-shaped blocks, in C order
of the block grid (the order its writer streamed them), so checking it streams too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..chunking import iter_regions
from ..errors import IntegrityError
from ..layout import Entry
from ..stores.base import Selection
from .shard_spec import Box, coverage_problems

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint

MAX_SHARDS = 1 << 20


@dataclass(frozen=True)
class StoredShard:
    box: Box
    rank: int
    crc32c: int
    unit: tuple[int, ...]


def _ints(value: Any, n: int, minimum: int) -> tuple[int, ...] | None:
    if not isinstance(value, list) or len(value) != n:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in value):
        return None
    return tuple(value)


def parse_shards(name: str, text: Any, shape: tuple[int, ...]) -> list[StoredShard]:
    """The ``shards`` attribute of one tensor, checked field by field."""
    where = f"tensor {name!r}"
    try:
        items = json.loads(text) if isinstance(text, str) else text
    except ValueError as exc:
        raise IntegrityError(f"{where}: shards attribute is not JSON ({exc})") from None
    if not isinstance(items, list) or len(items) > MAX_SHARDS:
        raise IntegrityError(f"{where}: shards attribute is not a list of shards")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise IntegrityError(f"{where}: shard {i} is not an object")
        offsets = _ints(item.get("offsets"), len(shape), 0)
        lengths = _ints(item.get("lengths"), len(shape), 0)
        unit = _ints(item.get("unit"), len(shape), 1)
        rank, crc = item.get("rank"), item.get("crc32c")
        if offsets is None or lengths is None or unit is None:
            raise IntegrityError(f"{where}: shard {i} has malformed offsets, lengths or unit")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise IntegrityError(f"{where}: shard {i} has a malformed rank {rank!r}")
        if not isinstance(crc, int) or isinstance(crc, bool) or not 0 <= crc < 2**32:
            raise IntegrityError(f"{where}: shard {i} has a malformed crc32c {crc!r}")
        out.append(StoredShard(Box(offsets, lengths), rank, crc, unit))
    return out


def stored_shards(ck: Checkpoint) -> dict[str, list[StoredShard]]:
    """Validated shards of every tensor of a sharded checkpoint ({} for an ordinary one).
    One IntegrityError lists every tensor whose shards overlap, leave gaps or are malformed."""
    if "sharded" not in ck.root_attrs:
        return {}
    from ..stores.hdf5.sharded import check_virtual_boxes

    problems: list[str] = []
    out: dict[str, list[StoredShard]] = {}
    for entry in ck.layout:
        shape = entry.shape or (1,)
        info = ck._stored[entry.name]
        try:
            shards = parse_shards(entry.name, info.attrs.get("shards"), shape)
            boxes = [s.box for s in shards]
            found = coverage_problems(shape, boxes, f"tensor {entry.name!r}")
            if not found:
                check_virtual_boxes(entry.name, info, boxes)
        except IntegrityError as exc:
            found = [str(exc)]
        problems.extend(found)
        out[entry.name] = shards
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise IntegrityError(
            f"{ck.path}: the recorded shards do not cover every tensor exactly once:\n{lines}"
        )
    return out


def _shift(region: tuple[slice, ...], box: Box) -> tuple[slice, ...]:
    return tuple(slice(s.start + o, s.stop + o) for s, o in zip(region, box.offsets))


def iter_shard_bits(ck: Checkpoint, entry: Entry, shard: StoredShard
                    ) -> Iterator[tuple[Any, np.ndarray]]:
    """Words of one shard in its digest order (global regions); the digest is checked last."""
    from ..integrity import crc32c_update

    node = ck._stored[entry.name].node
    crc = 0
    for local in iter_regions(shard.box.lengths, shard.unit):
        region = _shift(local, shard.box)
        words = ck._reader.read(node, Selection.of_region(region), entry.format)
        crc = crc32c_update(crc, words)
        yield region, words
    if crc != shard.crc32c:
        raise IntegrityError(
            f"tensor {entry.name!r}: shard {shard.box} (written by rank {shard.rank}) has crc32c "
            f"{crc:#010x}, the recorded digest is {shard.crc32c:#010x}; the checkpoint is corrupt"
        )


def iter_sharded_bits(ck: Checkpoint, entry: Entry, shards: list[StoredShard]
                      ) -> Iterator[tuple[Any, np.ndarray]]:
    """A whole sharded tensor, shard by shard (regions are not in C order of the tensor)."""
    if math.prod(entry.shape or (1,)) == 0:
        return
    for shard in shards:
        yield from iter_shard_bits(ck, entry, shard)


def verify_sharded_tensor(ck: Checkpoint, entry: Entry, report: Any, problem: Any) -> None:
    """``ls.verify`` for a sharded tensor: every shard read in its digest units (each unit's
    chunks checked by the store's own checksums) and its digest compared; one problem per
    bad shard, naming its box and writer rank."""
    from ..errors import CheckpointError

    for shard in ck._shards[entry.name]:
        try:
            for _region, words in iter_shard_bits(ck, entry, shard):
                report.chunks += 1
                report.nbytes += words.nbytes
        except CheckpointError as exc:
            report.problems.append(
                problem(entry.name, None, f"shard {shard.box} (rank {shard.rank}): {exc}")
            )
