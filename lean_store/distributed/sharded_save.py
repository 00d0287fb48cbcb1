"""Sharded save: every rank writes its own shards straight into the shared store.

Stages, each closed by an agreement (an all-gather of outcomes, so every rank raises the same
error if any rank failed and nothing is left half-visible):

1. describe: each rank's layout and box per tensor;
2. plan: same layout everywhere, distinct shards cover each tensor exactly once, owners of
   replicas = lowest rank holding them (computed by every rank from the same descriptions, so
   a bad plan raises the same error everywhere without an agreement round);
3. prepare: rank 0 creates the work root (hidden temporary directory, or the new URL prefix)
   and, for Zarr, every array's metadata;
4. write: each rank writes the shards it owns, with a crc32c digest per shard;
5. commit: rank 0 records shards and digests, writes the root attributes with ``complete``
   last and renames the work directory into place; on any failure it removes it instead.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from ..chunking import DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES, iter_regions, plan_chunks
from ..errors import CheckpointError
from ..integrity import crc32c_update
from ..layout import Layout
from ..metadata import root_attrs
from ..stores.commit import Commit
from ..stores.hdf5 import sharded as hdf5_sharded
from ..stores.registry import backend_for
from ..stores.zarr import sharded as zarr_sharded
from .collective import Collective, ShardedError
from .local_state import Piece, local_pieces
from .plan import TensorPlan, collect_digests, describe, make_plan, shard_records
from .shard_spec import Box

SHARDED_VERSION = 1


def _offset(region: tuple[slice, ...], box: Box) -> tuple[slice, ...]:
    return tuple(slice(s.start + o, s.stop + o) for s, o in zip(region, box.offsets))


def write_box(piece: Piece, box: Box, unit: tuple[int, ...], write: Any) -> int:
    """Stream ``box`` of this rank's local tensor to ``write(global_region, bits)`` in units of
    ``unit`` (C order of the unit grid); returns the crc32c of the words in that order."""
    source = piece.source()
    crc = 0
    for region in iter_regions(box.lengths, unit):
        bits = source.read(region)
        crc = crc32c_update(crc, bits)
        write(_offset(region, box), bits)
    return crc


def save(
    state: Any,
    path: Any,
    *,
    process_group: Any = None,
    backend: str | None = None,
    chunk_bytes: int | None = None,
    compression: Any = None,
    kind: str = "state",
    extra_root: dict[str, Any] | None = None,
) -> Layout:
    """Save sharded state from every rank of ``process_group`` (all ranks must call this).
    ``extra_root``: further root attributes, written by rank 0 (the same on every rank)."""
    comm = Collective(process_group)
    chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)

    # 1-2. describe and plan
    error: BaseException | None = None
    pieces: list[Piece] = []
    desc = None
    try:
        if chunk_bytes < MIN_CHUNK_BYTES:
            raise CheckpointError(f"chunk_bytes must be at least {MIN_CHUNK_BYTES}")
        backend = backend_for(path, backend)
        if backend == "hdf5":
            hdf5_sharded.require_local(path)
        pieces = local_pieces(state)
        if not pieces:
            raise CheckpointError("nothing to save: the state has no tensors")
        desc = describe(pieces)
    except Exception as exc:  # noqa: BLE001 - reported to every rank by agree()
        error = exc
    descriptions = agree(comm, error, desc)
    # every rank computes the plan from the same descriptions, so a bad plan raises the same
    # error on every rank without another agreement round
    layout, plans = make_plan(descriptions)
    assert backend is not None
    chunks = [zarr_sharded.chunk_plan(p, chunk_bytes) for p in plans] if backend == "zarr" else []

    # 3. prepare (rank 0)
    location: Commit | None = None
    error = None
    work = None
    if comm.rank == 0:
        try:
            location = Commit.at(path, directory=True)
            location.make_directory()
            work = location.work
            if backend == "zarr":
                zarr_sharded.create_arrays(work, plans, chunks, compression)
        except Exception as exc:  # noqa: BLE001
            error = exc
    try:
        work = agree(comm, error, work)[0]
        # 4. write
        error = None
        digests: dict[str, list[Any]] = {}
        try:
            if backend == "zarr":
                digests = _write_zarr(comm, work, plans, chunks, pieces)
            else:
                digests = _write_hdf5(comm, work, plans, pieces, chunk_bytes, compression)
        except Exception as exc:  # noqa: BLE001
            error = exc
        reports = agree(comm, error, digests)
        # 5. commit (rank 0)
        error = None
        if comm.rank == 0:
            assert location is not None
            try:
                merged = collect_digests(plans, reports)
                records = [shard_records(p, d) for p, d in zip(plans, merged)]
                meta = json.dumps({"version": SHARDED_VERSION, "world_size": comm.size,
                                   "id": uuid.uuid4().hex}, separators=(",", ":"))
                attrs = root_attrs(layout, kind, {**(extra_root or {}), "sharded": meta})
                if backend == "zarr":
                    zarr_sharded.finish(work, plans, records, attrs)
                else:
                    hdf5_sharded.write_master(work, comm.size, plans, records, attrs, chunk_bytes)
                location.commit()
            except Exception as exc:  # noqa: BLE001
                error = exc
        agree(comm, error)
    except BaseException:
        if location is not None:
            location.abort()
        raise
    return layout


def agree(comm: Collective, error: BaseException | None, payload: Any = None) -> list[Any]:
    """``comm.agree``, turning a broken collective (a dead peer, a timeout) into a
    CheckpointError so every surviving rank reports the failure the same way."""
    try:
        return comm.agree(error, payload)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch.distributed raises RuntimeError and others
        raise ShardedError(
            f"rank {comm.rank}: the process group failed during a sharded checkpoint operation "
            f"({type(exc).__name__}: {exc}); nothing was committed"
        ) from exc


def _write_zarr(comm: Collective, work: str, plans: list[TensorPlan], chunks: list[Any],
                pieces: list[Piece]) -> dict[str, list[Any]]:
    digests: dict[str, list[Any]] = {}
    turns: list[tuple[int, TensorPlan, Any]] = []
    for i, (plan, cp) in enumerate(zip(plans, chunks)):
        if not cp.aligned:
            turns.append((i, plan, cp))
            continue
        owned = plan.owned(comm.rank)
        if owned:
            sink = zarr_sharded.open_writer(work, plan, cp)
            for k, box in owned:
                crc = write_box(pieces[i], box, cp.chunks, sink.write)
                digests[f"{i}/{k}"] = [crc, list(cp.chunks)]
    if turns:
        digests.update(_write_in_turns(comm, work, turns, pieces))
    return digests


def _write_in_turns(comm: Collective, work: str, turns: list[tuple[int, TensorPlan, Any]],
                    pieces: list[Piece]) -> dict[str, list[Any]]:
    """Tensors whose shards share chunks: rank r writes while the others wait, so every
    read-modify-write of a shared chunk sees the previous rank's data."""
    digests: dict[str, list[Any]] = {}
    error: BaseException | None = None
    for turn in range(comm.size):
        if turn == comm.rank:
            try:
                for i, plan, cp in turns:
                    owned = plan.owned(comm.rank)
                    if not owned:
                        continue
                    sink = zarr_sharded.open_writer(work, plan, cp)
                    fmt = plan.entry.format
                    for k, box in owned:
                        unit = plan_chunks(box.lengths, fmt.storage_dtype.itemsize,
                                           DEFAULT_CHUNK_BYTES)
                        crc = write_box(pieces[i], box, unit, sink.write)
                        digests[f"{i}/{k}"] = [crc, list(unit)]
            except Exception as exc:  # noqa: BLE001
                error = exc
        agree(comm, error if turn == comm.rank else None)
    return digests


def _write_hdf5(comm: Collective, work: str, plans: list[TensorPlan], pieces: list[Piece],
                chunk_bytes: int, compression: Any) -> dict[str, list[Any]]:
    owned = [(i, plan, plan.owned(comm.rank)) for i, plan in enumerate(plans)]
    if not any(o for _, _, o in owned):
        return {}
    digests: dict[str, list[Any]] = {}
    writer = hdf5_sharded.open_rank_writer(work, comm.rank, comm.size, chunk_bytes, compression)
    with writer:
        for i, plan, boxes in owned:
            for k, box in boxes:
                entry = hdf5_sharded.shard_entry(plan, k, box)
                sink = writer.add_tensor(entry, {"tensor": plan.entry.name, "shard": k,
                                                 "offsets": box.offsets})
                crc = write_box(pieces[i], box, sink.write_unit,
                                lambda region, bits, box=box, sink=sink: sink.write(
                                    box.local(region), bits))
                sink.close({"crc32c": crc})
                digests[f"{i}/{k}"] = [crc, list(sink.write_unit)]
        writer.commit({"lean_store_shard": json.dumps(
            {"rank": comm.rank, "world_size": comm.size}, separators=(",", ":"))})
    return digests

