"""The recorded shards of a sharded checkpoint: parsed and validated (well-formed, every
element exactly once) when it is opened. :meth:`lean_store.Checkpoint.blocks` checks each
shard's crc32c digest when it reads the shard whole.

The digest of a shard is the crc32c of its raw words read in ``unit``-shaped blocks, in C order
of the block grid (the order its writer streamed them), so checking it streams too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import IntegrityError
from ..layout import Layout
from ..stores.base import StoredTensor
from .shard_spec import Box, coverage_problems

MAX_SHARDS = 1 << 20


@dataclass(frozen=True)
class StoredShard:
    """One recorded shard: its box of the tensor, the rank that wrote it, the crc32c digest of
    its words read in ``unit``-shaped blocks in C order of the block grid."""

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


def stored_shards(root_attrs: Mapping[str, Any], layout: Layout,
                  stored: Mapping[str, StoredTensor], where: str) -> dict[str, list[StoredShard]]:
    """Validated shards of every tensor of a sharded checkpoint ({} for an ordinary one).
    One IntegrityError lists every tensor whose shards overlap, leave gaps or are malformed."""
    if "sharded" not in root_attrs:
        return {}
    from ..stores.hdf5.sharded import check_virtual_boxes

    problems: list[str] = []
    out: dict[str, list[StoredShard]] = {}
    for entry in layout:
        shape = entry.shape or (1,)
        info = stored[entry.name]
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
            f"{where}: the recorded shards do not cover every tensor exactly once:\n{lines}"
        )
    return out
