"""Sharded checkpoints across processes with torch.distributed, with resharding on load.

Every rank calls ``ls.save(state, path, process_group=pg)`` / ``ls.load(target, path,
process_group=pg)``; a state holding DTensors (or :class:`LocalShard` values) is sharded even
without ``process_group`` (the default group is used). Each rank writes only its own shards
into the shared store (Zarr: one array per tensor, chunks aligned to shard boundaries; HDF5: one
file per rank plus a master file of virtual datasets), and reads back only the regions its new
shards need. ``ls.open`` reads a sharded checkpoint as whole tensors in a single process.
Whether a call is sharded is decided by the API layer (:func:`lean_store.api.is_sharded`).
See docs/SHARDING.md. torch is imported only when a sharded operation runs.
"""

from __future__ import annotations

from typing import Any

from .local_state import LocalShard
from .shard_spec import Box, ShardSpec, check_coverage, coverage_problems


def training_state(model: Any, optimizer: Any = None) -> dict[str, Any]:
    """A flat state of ``model`` (its state_dict, DTensors kept) and the per-parameter tensors
    of ``optimizer`` (``optim/<param name>/<key>``), for sharded save and in-place load. A
    plain dict that remembers the model's extra-state entries: a load into it hands them to
    their modules' ``set_extra_state``."""
    from .optim import training_state as _impl

    return _impl(model, optimizer)


def init_optimizer_state(optimizer: Any) -> None:
    """Create the optimizer's per-parameter state without changing any parameter, so that a
    fresh optimizer can be loaded into in place."""
    from .optim import init_optimizer_state as _impl

    _impl(optimizer)


__all__ = [
    "Box", "LocalShard", "ShardSpec", "check_coverage", "coverage_problems",
    "init_optimizer_state", "training_state",
]
