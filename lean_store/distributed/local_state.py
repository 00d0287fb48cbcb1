"""What this rank holds: each state entry as a global tensor and this rank's box of it.

A value is a DTensor (Shard/Replicate placements), a :class:`LocalShard` (a plain local tensor
plus its global shape and offsets, for users without DTensor), or an ordinary tensor/array,
which is replicated: every rank holds all of it and one of them writes it (plan.balance_replicas).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError
from ..formats import ScalarFormat
from ..layout import Layout
from ..naming import check_names
from ..sources import tensor_source, tensor_targets
from ..sources.base import SourceTensor, TargetTensor
from ..sources.module_names import canonical_state
from .shard_spec import Box, ShardSpec


@dataclass
class LocalShard:
    """A plain local tensor (torch or numpy) that is the block ``offsets`` of a tensor of
    ``global_shape``: ``ls.save({"w": LocalShard(t, (1024, 512), (256, 0))}, path,
    process_group=pg)``."""

    tensor: Any
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(d) for d in self.global_shape)
        self.offsets = tuple(int(o) for o in self.offsets)

    @property
    def spec(self) -> ShardSpec:
        shape = tuple(int(d) for d in self.tensor.shape)
        if len(shape) != len(self.global_shape):
            raise CheckpointError(
                f"local shard of rank {len(shape)} for a global shape {self.global_shape}"
            )
        return ShardSpec.of(self.global_shape, self.offsets, shape)


@dataclass
class Piece:
    """One entry of the local state: its global shape and format, and this rank's box."""

    name: str
    global_shape: tuple[int, ...]
    format: ScalarFormat
    box: Box  # in stored coordinates (a scalar is stored as shape (1,))
    local: Any  # the local tensor or array holding ``box``
    sharded: bool  # False: an ordinary (replicated) value
    strided: str = ""  # a DTensor with a strided placement: its placements in plain words

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return self.global_shape or (1,)

    def source(self) -> SourceTensor:
        """Reads regions of the box, in box-local coordinates, as raw words."""
        fmt = _format(self.name, self.local)
        if fmt != self.format:
            raise CheckpointError(f"{self.name!r}: local format {fmt.tag} differs")
        if _is_torch(self.local):
            from ..sources.torch_source import value_source

            return value_source(self.local, fmt)
        ((_entry, tensor),) = list(tensor_source({self.name: self.local}).tensors())
        return tensor

    def target(self) -> TargetTensor:
        """Writes regions of the box, in box-local coordinates, in place."""
        return tensor_targets({self.name: self.local})[self.name]


def is_dtensor(value: Any) -> bool:
    """True for a DTensor; never imports torch (no DTensor exists before its module loads)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(value, dtensor)


def state_items(state: Any) -> Mapping[str, Any]:
    """The entries of a module (its state_dict, DTensors kept, named without torch.compile's
    ``_orig_mod`` components) or of a mapping."""
    if callable(getattr(state, "state_dict", None)) and not isinstance(state, Mapping):
        return canonical_state(state.state_dict())
    if isinstance(state, Mapping):
        return state
    raise CheckpointError(
        f"cannot take sharded state from a {type(state).__name__}: pass a module or a mapping"
    )


def holds_shards(state: Any) -> bool:
    """True when ``state`` has a DTensor or a LocalShard (so a save or load must be sharded)."""
    try:
        items = state_items(state)
    except CheckpointError:
        return False
    return any(isinstance(v, LocalShard) or is_dtensor(v) for v in items.values())


def local_pieces(state: Any) -> list[Piece]:
    """This rank's piece of every entry, in the state's order."""
    items = state_items(state)
    check_names(list(items))
    blocks: dict[Any, Any] = {}  # one block computation per (shape, mesh, placements)
    return [_piece(name, value, blocks) for name, value in items.items()]


def layout_of(pieces: Sequence[Piece]) -> Layout:
    return Layout.from_specs([(p.name, p.global_shape, p.format) for p in pieces])


def _piece(name: str, value: Any, blocks: dict[Any, Any] | None = None) -> Piece:
    if isinstance(value, LocalShard):
        spec = value.spec
        fmt = _format(name, value.tensor)
        box = spec.box if spec.global_shape else Box((0,), (1,))
        return Piece(name, spec.global_shape, fmt, box, value.tensor, True)
    if is_dtensor(value):
        return _dtensor_piece(name, value, blocks)
    fmt = _format(name, value)
    shape = tuple(int(d) for d in getattr(value, "shape", ()))
    return Piece(name, shape, fmt, Box.whole(shape or (1,)), value, False)


def _is_torch(value: Any) -> bool:
    torch = sys.modules.get("torch")  # never imported here: no torch tensor exists without it
    return torch is not None and isinstance(value, torch.Tensor)


def _format(name: str, value: Any) -> ScalarFormat:
    if _is_torch(value):  # one value's checks, not a whole TorchSource's
        from ..sources.torch_source import value_format

        return value_format(name, value)
    return tensor_source({name: value}).layout[name].format


def _dtensor_piece(name: str, value: Any, blocks: dict[Any, Any] | None = None) -> Piece:
    import torch

    from .dtensor_blocks import describe_placements, is_strided, local_block

    shape = tuple(int(d) for d in value.shape)
    # the block depends only on the global shape, the mesh and the placements (optimizer
    # moments share their parameter's): computed once for each (torch's ~0.5 ms)
    key = (shape, id(value.device_mesh), tuple(value.placements))
    found = None if blocks is None else blocks.get(key)
    if found is None:
        found = local_block(name, value)
        if blocks is not None:
            blocks[key] = found
    local_shape, offsets = found
    with torch.no_grad():
        local = value.to_local()
    if tuple(local.shape) != tuple(local_shape):
        raise CheckpointError(
            f"{name!r}: local tensor of shape {tuple(local.shape)}, placements say {local_shape}"
        )
    fmt = _format(name, local)
    box = Box.of(offsets, local_shape) if shape else Box((0,), (1,))
    strided = describe_placements(value.placements) if is_strided(value.placements) else ""
    return Piece(name, shape, fmt, box, local, True, strided)


def strided_boxes(pieces: Sequence[Piece]) -> list[list[Any]]:
    """This rank's strided pieces as JSON, for :func:`dtensor_blocks.check_target_cover`."""
    return [[p.name, p.strided, list(p.stored_shape), list(p.box.offsets), list(p.box.lengths)]
            for p in pieces if p.strided]


__all__ = ["LocalShard", "Piece", "holds_shards", "layout_of", "local_pieces", "state_items",
           "strided_boxes"]
