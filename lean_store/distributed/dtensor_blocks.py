"""Where a DTensor's local tensor lies in the global tensor: one box per rank.

Placements: ``Shard(d)``, ``Replicate()``, and the strided shards that FSDP2 on top of tensor
parallelism (or HSDP) produces (torch's ``_StridedShard``: a dimension sharded first by one mesh
dimension, then by another, "right to left"). For those torch computes the global offset of the
local block with ``compute_local_shape_and_global_offset`` (a private helper that DCP uses
too); this module is the only place that calls it. Without it (another torch), plain
``Shard``/``Replicate`` boxes are computed here and strided placements are refused.

A strided placement gives every rank one contiguous block in the layouts torch builds for
FSDP2 + TP. Other strided layouts give ranks interleaved rows; such boxes cannot cover the
tensor exactly once, so the save plan (and, at load, :func:`check_target_cover`) refuses them
with :func:`strided_refusal` instead of placing rows in the wrong spot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import CheckpointError
from .shard_spec import Box, coverage_problems

DCP_HINT = (
    "torch.distributed.checkpoint with lean_store.interop.dcp.StorageWriter/StorageReader "
    "writes and reads the same lean_store format through DCP's planners"
)


def describe_placement(placement: Any) -> str:
    """A placement in plain words (never torch's short form such as ``_S(0, 2)``)."""
    kind = type(placement).__name__
    dim = getattr(placement, "dim", None)
    if kind == "_StridedShard":
        return f"strided Shard({dim}) with split factor {getattr(placement, 'split_factor', '?')}"
    if kind == "Shard":
        return f"Shard({dim})"
    if kind == "Replicate":
        return "Replicate()"
    if kind in ("Partial", "_Partial", "MaskPartial", "_MaskPartial"):
        return f"Partial({getattr(placement, 'reduce_op', 'sum')})"
    return kind


def describe_placements(placements: Sequence[Any]) -> str:
    return "(" + ", ".join(describe_placement(p) for p in placements) + ")"


def is_strided(placements: Sequence[Any]) -> bool:
    return any(type(p).__name__ == "_StridedShard" for p in placements)


def _check_placements(name: str, placements: Sequence[Any]) -> None:
    from torch.distributed.tensor import Replicate, Shard

    for mesh_dim, p in enumerate(placements):
        if isinstance(p, (Shard, Replicate)) or type(p).__name__ == "_StridedShard":
            continue
        what = describe_placement(p)
        if "Partial" in what:
            raise CheckpointError(
                f"{name!r}: DTensor placement {what} on mesh dimension {mesh_dim} holds partial "
                "results that still have to be reduced, not a block of the tensor; reduce it "
                "first (dtensor.redistribute(mesh, [Replicate()] or [Shard(d)]))"
            )
        raise CheckpointError(
            f"{name!r}: DTensor placement {what} on mesh dimension {mesh_dim} is not supported: "
            "lean_store saves a DTensor whose placements are Shard, Replicate or the strided "
            f"shards of FSDP2 with tensor parallelism; {DCP_HINT}"
        )


def local_block(name: str, value: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local_shape, global_offsets)`` of this rank's block of the DTensor ``value``."""
    placements = tuple(value.placements)
    _check_placements(name, placements)
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        if is_strided(placements):
            raise CheckpointError(
                f"{name!r}: DTensor placements {describe_placements(placements)} include a "
                "strided shard, and this torch does not say where its block lies; "
                f"{DCP_HINT}"
            ) from None
        return plain_block(value)
    shape, offsets = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, placements)
    return tuple(int(n) for n in shape), tuple(int(o) for o in offsets)


def plain_block(value: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shard/Replicate only: torch.chunk sizes (ceil(n / k), the last ones shorter or empty)
    applied mesh dimension by mesh dimension."""
    shape = [int(d) for d in value.shape]
    offsets = [0] * len(shape)
    coords = value.device_mesh.get_coordinate()
    for mesh_dim, p in enumerate(value.placements):
        dim = getattr(p, "dim", None)
        if dim is None:
            continue
        k = value.device_mesh.size(mesh_dim)
        step = -(-shape[dim] // k)
        start = min(coords[mesh_dim] * step, shape[dim])
        offsets[dim] += start
        shape[dim] = min(step, shape[dim] - start)
    return tuple(shape), tuple(offsets)


def strided_refusal(name: str, placements: str, problems: Sequence[str]) -> CheckpointError:
    """The error for a strided layout whose rows are interleaved across ranks."""
    detail = "; ".join(problems[:3])
    return CheckpointError(
        f"tensor {name!r}: its DTensor placements {placements} give some ranks rows that are not "
        "one contiguous block (they interleave with other ranks' rows), which a lean_store "
        "shard record cannot describe; redistribute it to Shard/Replicate placements first, or "
        f"save it through {DCP_HINT} ({detail})"
    )


def check_target_cover(reports: Sequence[Any]) -> None:
    """At load, every rank's strided targets (``reports[r]``: ``[[name, placements, shape,
    offsets, lengths], ...]``) must tile each tensor exactly once, else their blocks are not
    where ``compute_local_shape_and_global_offset`` says; every rank raises the same error."""
    by_name: dict[str, tuple[str, tuple[int, ...], set[Box]]] = {}
    for report in reports:
        for name, placements, shape, offsets, lengths in report or []:
            entry = by_name.setdefault(name, (placements, tuple(shape), set()))
            entry[2].add(Box.of(offsets, lengths))
    for name, (placements, shape, boxes) in by_name.items():
        problems = coverage_problems(shape, sorted(boxes), f"tensor {name!r}")
        if problems:
            raise strided_refusal(name, placements, problems)


__all__ = ["check_target_cover", "describe_placements", "local_block", "strided_refusal"]
