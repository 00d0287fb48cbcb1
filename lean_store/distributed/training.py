"""Sharded training checkpoints: ``ls.save_training`` / ``ls.load_training`` (and the optimizer
variants) with DTensor models, across the ranks of a process group.

Saving: every rank builds the same tensors and metadata as the single-process save
(:func:`lean_store.training.state.training_tensors`), and :func:`gather_training_state` agrees
on them before the ordinary sharded save writes them: parameters and moments stay DTensors, so
each rank writes only its own shards; numbers, hyperparameter tensors and scheduler state are
replicated and written once. Every rank's RNG states are stored too: each RNG tensor is stacked
over a leading rank axis (rank ``r`` writes row ``r``) and the metadata keeps one RNG record per
rank (``rng.ranks``). The metadata without RNG must be identical on every rank; rank 0 writes it.

Loading: every rank runs the single-process validation
(:func:`~lean_store.training.state.prepare_load`) with hooks that read only this rank's regions
(model tensors and moments, resharded to the live placements), then the ranks agree; every
stored shard's digest is checked once across the ranks, they agree again, and only then does
any rank install anything. A rank gets its own RNG states back when the world size matches the
saving one; otherwise RNG is skipped with a warning on every rank.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ..chunking import DEFAULT_CHUNK_BYTES
from ..errors import CheckpointError
from ..layout import Layout
from ..sources.module_names import respelled, spelled_under
from .collective import Collective, stage
from .dtensor_blocks import check_target_cover
from .local_state import LocalShard, Piece, is_dtensor, layout_of, local_pieces, strided_boxes
from .shard_spec import Box
from .sharded_load import install_piece, stored_boxes, verify_shards


def _stack(value: Any, rank: int, world: int) -> LocalShard:
    """This rank's row of a tensor stacked over a leading rank axis."""
    import numpy as np
    import torch

    row: torch.Tensor | np.ndarray
    if isinstance(value, torch.Tensor):
        row = value.detach().reshape((1, *value.shape))
    else:
        row = np.asarray(value).reshape((1, *np.shape(value)))
    shape = tuple(int(d) for d in row.shape[1:])
    return LocalShard(row, (world, *shape), (rank,) + (0,) * len(shape))


def _first_difference(a: Any, b: Any, where: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b or a[key] != b[key]:
                return _first_difference(a.get(key), b.get(key), f"{where}/{key}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{where}/{i}")
    return where or "/"


def gather_training_state(
    build: Callable[[], tuple[dict[str, Any], dict[str, Any], dict[str, Any], Any]],
    *, process_group: Any,
) -> tuple[dict[str, Any], str]:
    """Every rank of ``process_group`` calls this with its own ``build()`` (tensors, metadata
    without RNG, RNG tensors, RNG metadata, as a single-process save builds them). Returns the
    tensors to save sharded (RNG tensors stacked over a leading rank axis) and the metadata
    text every rank holds; raises on every rank if any rank failed or the metadata differs."""
    comm = Collective(process_group)
    tensors: dict[str, Any] = {}
    with stage(comm) as st:
        tensors, meta, local_rng, rng_meta = build()
        clash = sorted(set(local_rng) & set(tensors))
        if clash:
            raise CheckpointError(f"tensor names {clash[:4]} are used twice")
        tensors.update({n: _stack(v, comm.rank, comm.size) for n, v in local_rng.items()})
        st.share({"meta": meta, "rng": rng_meta})
    reports = st.shared
    text = ""
    with stage(comm):
        first = reports[0]["meta"]
        differ = [r for r, rep in enumerate(reports) if rep["meta"] != first]
        if differ:
            where = _first_difference(first, reports[differ[0]]["meta"])
            raise CheckpointError(
                f"ranks {differ[:8]} hold other training metadata than rank 0 (first difference "
                f"at {where}): step, hyperparameters, scheduler, data position and extras must "
                "be the same on every rank of a sharded training checkpoint"
            )
        full = dict(first)
        if reports[0]["rng"] is not None:
            full["rng"] = {"ranks": [rep["rng"] for rep in reports]}
        text = json.dumps(full, separators=(",", ":"), allow_nan=False)
    return tensors, text


class _ShardedReads:
    """The hooks that make :func:`~lean_store.training.state.prepare_load` read this rank's
    shards."""

    def __init__(self, ck: Any, optimizer: Any, names: list[str], block_bytes: int) -> None:
        self.ck = ck
        self.block_bytes = block_bytes
        self.params: dict[str, Any] = {}
        self.strided: list[list[Any]] = []  # this rank's strided targets, checked across ranks
        self.optimizer = optimizer
        if optimizer is not None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            for name, param in zip(names, params):
                self.params[f"optimizer/state/{name}"] = param
                self.params[f"state/{name}"] = param  # format version 0

    def prepare_model(self, ck: Any, model: Any) -> Callable[[], None]:
        """Check the model's global layout against the file; install reads this rank's
        regions of every model tensor straight into its local shards."""
        from ..sources.torch_source import state_dict_of

        state = state_dict_of(model)
        # named as the checkpoint spells them (a wrapper's names: sources/module_names.py)
        state = respelled(state, spelled_under(state, ck.layout.names(), "model/"))
        stored = [e for e in ck.layout if e.name.startswith("model/")]
        pieces = local_pieces({f"model/{n}": v for n, v in state.items()})
        self.strided.extend(strided_boxes(pieces))
        actual = Layout.from_specs([(e.name, e.shape, e.format) for e in stored])
        actual.check(layout_of(pieces))

        def install() -> None:
            for piece in pieces:
                install_piece(ck, piece, stored_boxes(ck, piece.name), self.block_bytes)

        return install

    def read_state(self, name: str, device: Any) -> Any:
        """An optimizer state tensor: a DTensor with its parameter's (or live moment's)
        placement, holding only this rank's region; anything else is read whole."""
        from ..sources.torch_source import dtype_of_format
        from ..training.state import TrainingReader

        base, key = name.rsplit("/", 1)
        param = self.params.get(base)
        live = self.optimizer.state.get(param, {}).get(key) if param is not None else None
        like = live if is_dtensor(live) else param if is_dtensor(param) else None
        entry = self.ck.layout[name]
        if like is None or tuple(like.shape) != entry.shape:
            return TrainingReader(self.ck).tensor(name, device)  # e.g. a replicated step count
        import torch
        from torch.distributed.tensor import DTensor

        from .dtensor_blocks import describe_placements, is_strided, local_block

        local_shape, offsets = local_block(name, like)
        local = torch.empty(tuple(local_shape), dtype=dtype_of_format(entry.format),
                            device=like.to_local().device)
        box = Box.of(offsets, local_shape) if entry.shape else Box((0,), (1,))
        strided = describe_placements(like.placements) if is_strided(like.placements) else ""
        piece = Piece(name, entry.shape, entry.format, box, local, True, strided)
        self.strided.extend(strided_boxes([piece]))
        install_piece(self.ck, piece, stored_boxes(self.ck, name), self.block_bytes)
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())


def load_training(
    path: Any, *, process_group: Any, model: Any, names_model: Any, optimizer: Any,
    scheduler: Any = None, data: Any = None, rng: bool = True,
    generators: Mapping[str, Any] | None = None, scheduled: Collection[str] = (),
    stacklevel: int = 2, verify: bool = True, block_bytes: int = DEFAULT_CHUNK_BYTES,
    scaler: Any = None,
) -> Any:
    """Every rank of ``process_group`` calls this; see the module docstring."""
    from ..checkpoint import Checkpoint
    from ..sources.optimizer import param_names
    from ..training.state import prepare_load, read_metadata, stored_spelling, warn_lost

    comm = Collective(process_group)
    ck = None
    prepared = None
    hooks = None
    try:
        with stage(comm) as st:  # validate everything on every rank
            ck = Checkpoint(path)
            # the parameters' names as the checkpoint spells them, as prepare_load spells them
            names = stored_spelling(param_names(optimizer, names_model),
                                    read_metadata(ck)[1].get("optimizer")) \
                if optimizer is not None else []
            hooks = _ShardedReads(ck, optimizer, names, block_bytes)
            prepared = prepare_load(
                ck, model=model, names_model=names_model, optimizer=optimizer, rng=rng,
                generators=generators, scheduled=scheduled, scheduler=scheduler, data=data,
                scaler=scaler, rank=comm.rank, world=comm.size, prepare_model=hooks.prepare_model,
                read_state=hooks.read_state)
            if not verify:  # what the install reads, checked before it (as a single load)
                for name in ck.layout.names():
                    ck.check_metadata(name)
            st.share(hooks.strided)
        check_target_cover(st.shared)
        assert ck is not None and prepared is not None
        if verify:  # every stored shard's digest, each checked by one rank
            verify_shards(ck, ck.layout.names(), comm)
        with stage(comm):
            prepared.install()
    finally:
        if ck is not None:
            ck.close()
    warn_lost(path, prepared.lost, stacklevel)
    return prepared.info


__all__ = ["gather_training_state", "load_training"]
