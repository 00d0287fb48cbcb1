"""``lean_store.interop.dcp.StorageWriter``: torch.distributed.checkpoint writes a lean_store
sharded checkpoint.

DCP's planners decide what each rank writes (``WriteItem``: a key, a chunk's offsets and
sizes, after replicas were deduplicated); this writer maps those chunks onto lean_store's
sharded layout (``lean_store.distributed``) and reuses its writers:

- ``prepare_global_plan`` (coordinator): the layout, each tensor's shards and owners
  (checked to cover every tensor exactly once), the hidden work directory and, for Zarr, every
  array's metadata; each rank's plan carries its part of that plan;
- ``write_data`` (every rank): each owned chunk is streamed into the store with its crc32c
  digest (Zarr: chunks aligned to the shards; HDF5: this rank's ``shard-R-of-W.h5``), and
  non-tensor values are turned into plain JSON (:mod:`lean_store.interop.dcp.objects`);
- ``finish`` (coordinator): the shard records, the root attributes (``complete`` last), the HDF5
  master file, and the atomic rename into place.

The result is an ordinary lean_store sharded checkpoint: ``ls.open``, ``ls.load_state``,
``ls.load`` at any world size, ``lean-store verify``, h5py/h5dump and zarr read it.
"""

from __future__ import annotations

import io
import json
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint import storage
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.futures import Future

from ...chunking import DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES
from ...distributed.local_state import Piece
from ...distributed.plan import TensorPlan, collect_digests, shard_records
from ...distributed.shard_spec import Box, ChunkPlan, assign_owners
from ...distributed.sharded_save import SHARDED_VERSION
from ...errors import CheckpointError
from ...layout import Layout
from ...metadata import root_attrs
from ...naming import check_names
from ...sources.torch_source import format_of_dtype
from ...stores.commit import Commit, at_call_time, is_url
from ...stores.registry import backend_for, backend_record
from .objects import ROOT_ATTR, encode_object, objects_attr


def chunk_box(offsets: Any, sizes: Any) -> Box:
    """A DCP chunk as a lean_store box (a 0-d tensor is stored with shape (1,))."""
    if len(sizes) == 0:
        return Box((0,), (1,))
    return Box.of(offsets, sizes)


@dataclass
class RankTask:
    """What one rank writes, sent from the coordinator in ``SavePlan.storage_data``."""

    work: str
    backend: str
    world: int
    rank: int
    plans: list[TensorPlan]
    chunks: list[ChunkPlan | None]
    shard_of: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = field(default_factory=dict)


def _fqn_order(plans: list[SavePlan]) -> list[str]:
    """Keys in state-dict order: each rank's local plan lists its keys in that order before
    DCP deduplicates replicas, and ``prepare_local_plan`` kept that list."""
    order: dict[str, None] = {}
    for plan in plans:
        for key in plan.storage_data or []:
            order.setdefault(key, None)
        for item in plan.items:
            order.setdefault(item.index.fqn, None)
    return list(order)


class StorageWriter(storage.StorageWriter):
    """Writes ``dcp.save`` / ``dcp.async_save`` state as a lean_store checkpoint at ``path``
    (``.zarr``, a Zarr URL, or ``.h5``: a directory of per-rank files plus a master file).

    ``chunk_bytes``/``compression`` as for ``ls.save``; ``allow_pickle``: keep non-tensor values
    that are not plain data as torch.save bytes instead of refusing them."""

    def __init__(self, path: str | os.PathLike | None = None, *, backend: str | None = None,
                 chunk_bytes: int | None = None, compression: Any = None,
                 allow_pickle: bool = False) -> None:
        super().__init__()
        # anchored now: DCP's async_save writes from a thread, maybe after a chdir
        self.path = None if path is None else at_call_time(path_string(path))
        self.backend = backend
        self.chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
        if self.chunk_bytes < MIN_CHUNK_BYTES:
            raise CheckpointError(f"chunk_bytes must be at least {MIN_CHUNK_BYTES}")
        self.compression = compression
        self.allow_pickle = bool(allow_pickle)
        self.is_coordinator = False
        self.rank = 0
        self.save_id = uuid.uuid4().hex
        self._location: Commit | None = None
        self._layout: Layout | None = None
        self._plans: list[TensorPlan] = []
        self._backend = ""
        self._layout_of_shards: Any = None  # the backend's ShardedLayout, once set up

    # ------------------------------------------------------------------ identity and set-up

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = at_call_time(path_string(checkpoint_id))
        self.save_id = uuid.uuid4().hex
        self._location = None
        self._layout = None
        self._plans = []

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            backend_for(path_string(checkpoint_id))
        except CheckpointError:
            return False
        return True

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.path is None:
            raise CheckpointError(
                "lean_store.interop.dcp.StorageWriter needs a path (or checkpoint_id)")
        if not kwargs.get("use_collectives", True) and _world_size() > 1:
            raise CheckpointError(
                "lean_store.interop.dcp.StorageWriter needs DCP's collectives "
                "(use_collectives=True): its coordinator plans the shards of every rank and "
                "commits the checkpoint once"
            )
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        self._backend = backend_for(self.path, self.backend)
        self._layout_of_shards = backend_record(self._backend).sharded()
        self._layout_of_shards.check_target(self.path)

    # ----------------------------------------------------------------------------- planning

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        keys = list(dict.fromkeys(item.index.fqn for item in plan.items))
        check_names(keys)
        return SavePlan(plan.items, storage_data=keys, planner_data=plan.planner_data,
                        usable=plan.usable)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        assert self.path is not None
        order = _fqn_order(plans)
        specs: dict[str, tuple[tuple[int, ...], Any]] = {}
        held: dict[str, list[list[Box]]] = {}
        for rank, plan in enumerate(plans):
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    continue
                data = _tensor_data(item)
                key = item.index.fqn
                shape = tuple(int(d) for d in data.size)
                spec = (shape, format_of_dtype(data.properties.dtype))
                if specs.setdefault(key, spec) != spec:
                    raise CheckpointError(f"tensor {key!r}: ranks disagree on its shape or dtype")
                held.setdefault(key, [[] for _ in plans])[rank].append(
                    chunk_box(data.chunk.offsets, data.chunk.sizes))
        names = [k for k in order if k in specs]
        layout = Layout.from_specs([(k, specs[k][0], specs[k][1]) for k in names])
        tensor_plans = []
        for entry in layout:
            shards = assign_owners(entry.shape or (1,), held[entry.name],
                                   f"tensor {entry.name!r}")
            tensor_plans.append(TensorPlan(entry, tuple(shards)))
        # DCP's ranks write at once: never a chunk shared between ranks
        chunks = self._layout_of_shards.chunk_plans(tensor_plans, self.chunk_bytes,
                                                    always_aligned=True)
        location = Commit.at(self.path, directory=True)
        location.make_directory()
        try:
            self._layout_of_shards.prepare(location.work, tensor_plans, chunks, self.compression)
        except BaseException:
            location.abort()
            raise
        self._location, self._layout, self._plans = location, layout, tensor_plans
        index = {p.entry.name: i for i, p in enumerate(tensor_plans)}
        out = []
        for rank, plan in enumerate(plans):
            task = RankTask(location.work, self._backend, len(plans), rank, tensor_plans, chunks)
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    continue
                i = index[item.index.fqn]
                chunk = _tensor_data(item).chunk
                box = chunk_box(chunk.offsets, chunk.sizes)
                if box.empty:
                    continue  # an empty local shard (uneven sharding): nothing to write
                k = [b for b, _ in tensor_plans[i].shards].index(box)
                task.shard_of[_item_key(item.index)] = (i, k)
            out.append(SavePlan(plan.items, storage_data=task, planner_data=plan.planner_data,
                                usable=plan.usable))
        return out

    # ------------------------------------------------------------------------------ writing

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[storage.WriteResult]]:
        task: RankTask = plan.storage_data
        results: list[storage.WriteResult] = []
        try:
            tensors = []
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    results.append(self._write_object(item, planner))
                elif _item_key(item.index) in task.shard_of:
                    tensors.append(item)
            if tensors:
                results.extend(_write_shards(task, tensors, planner, self.chunk_bytes,
                                             self.compression))
        except BaseException:
            # the coordinator removes the work directory it created; DCP never calls finish
            # after a failed write (a failure on another rank leaves the hidden directory,
            # which is never read as a checkpoint)
            if self.is_coordinator and self._location is not None:
                self._location.abort()
                self._location = None
            raise
        future: Future[list[storage.WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_object(self, item: Any, planner: SavePlanner) -> storage.WriteResult:
        key = item.index.fqn
        lookup = getattr(planner, "lookup_object", None)
        pickled = None
        if callable(lookup):
            value = lookup(item.index)
        else:
            buf = planner.resolve_data(item)
            if not isinstance(buf, io.BytesIO):
                raise CheckpointError(f"object {key!r}: the planner resolved it to a "
                                      f"{type(buf).__name__}, not bytes")
            pickled = buf.getvalue()
            buf.seek(0)
            value = torch.load(buf, weights_only=True)
        if self.allow_pickle and pickled is None:
            pickled = _saved_bytes(planner.resolve_data(item))
        record = encode_object(key, value, pickled, self.allow_pickle)
        size = len(json.dumps(record))
        return storage.WriteResult(index=item.index, size_in_bytes=size,
                                   storage_data={"object": record})

    # ------------------------------------------------------------------------------- commit

    def finish(self, metadata: Metadata, results: list[list[storage.WriteResult]]) -> None:
        location, layout = self._location, self._layout
        if location is None or layout is None:
            raise CheckpointError("finish() called without prepare_global_plan()")
        try:
            reports: list[dict[str, Any]] = []
            objects: dict[str, dict] = {}
            for rank_results in results:
                report: dict[str, Any] = {}
                for result in rank_results:
                    data = result.storage_data
                    if "object" in data:
                        objects[result.index.fqn] = data["object"]
                    else:
                        report[f"{data['i']}/{data['k']}"] = [data["crc"], data["unit"]]
                reports.append(report)
            merged = collect_digests(self._plans, reports)
            records = [shard_records(p, d) for p, d in zip(self._plans, merged)]
            sharded = json.dumps({"version": SHARDED_VERSION, "world_size": len(results),
                                  "id": self.save_id}, separators=(",", ":"))
            ordered = {k: objects[k] for k in sorted(objects)}
            attrs = root_attrs(layout, "state", {"sharded": sharded,
                                                 ROOT_ATTR: objects_attr(ordered)})
            self._layout_of_shards.finish(location.work, len(results), self._plans, records,
                                          attrs, self.chunk_bytes)
            location.commit()
        except BaseException:
            location.abort()
            raise
        finally:
            self._location = None


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def path_string(path: str | os.PathLike) -> str:
    return path if is_url(path) else os.fspath(path)


def _item_key(index: MetadataIndex) -> tuple[str, tuple[int, ...]]:
    return index.fqn, tuple(int(o) for o in (index.offset or ()))


def _tensor_data(item: WriteItem) -> TensorWriteData:
    """The tensor part of a write item (torch gives one with every item that is not bytes)."""
    if item.tensor_data is None:
        raise CheckpointError(f"tensor {item.index.fqn!r}: the save plan gives no tensor data")
    return item.tensor_data


def _saved_bytes(data: Any) -> bytes:
    return data.getvalue() if hasattr(data, "getvalue") else bytes(data)


def _piece(task: RankTask, item: Any, planner: SavePlanner) -> tuple[int, int, Piece, Box]:
    i, k = task.shard_of[_item_key(item.index)]
    plan = task.plans[i]
    box, owner = plan.shards[k]
    if owner != task.rank:
        raise CheckpointError(f"tensor {plan.entry.name!r}: shard {box} belongs to rank {owner}")
    tensor = planner.resolve_data(item)
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"tensor {plan.entry.name!r}: the planner resolved a "
                              f"{type(tensor).__name__}, not a tensor")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    local = tensor.contiguous().reshape(box.lengths)
    piece = Piece(plan.entry.name, plan.entry.shape, plan.entry.format, box, local, True)
    return i, k, piece, box


def _result(item: Any, i: int, k: int, crc: int, unit: Any, nbytes: int
            ) -> storage.WriteResult:
    return storage.WriteResult(index=item.index, size_in_bytes=nbytes,
                               storage_data={"i": i, "k": k, "crc": int(crc), "unit": list(unit)})


def _write_shards(task: RankTask, items: list[Any], planner: SavePlanner, chunk_bytes: int,
                  compression: Any) -> list[storage.WriteResult]:
    out = []
    layout = backend_record(task.backend).sharded()
    with layout.rank_writer(task.work, task.rank, task.world, chunk_bytes, compression) as writer:
        for item in items:
            i, k, piece, box = _piece(task, item, planner)
            crc, unit = writer.write(task.plans[i], task.chunks[i], k, box, piece.source().read)
            out.append(_result(item, i, k, crc, unit, piece.local.nbytes))
    return out
