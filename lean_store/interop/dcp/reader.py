"""``lean_store.interop.dcp.StorageReader``: torch.distributed.checkpoint loads any lean_store
checkpoint (single-process or sharded, Zarr or HDF5, written by ``ls.save`` or by
:class:`lean_store.interop.dcp.StorageWriter`) at any world size.

The metadata DCP plans with comes from the checkpoint itself: every tensor whose format torch
can hold, with its stored shards as DCP chunks (one whole-tensor chunk for an unsharded
checkpoint), and the non-tensor values stored by the writer. DCP's load planner then asks for
regions of those chunks; each is read through lean_store's validated reader (every chunk's
checksum is checked as it is read) and copied into the destination DCP resolves.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint import storage
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ...checkpoint import Checkpoint
from ...errors import CheckpointError
from ...layout import Entry
from ...sources.torch_source import bit_view, dtype_of_format, new_tensor
from ...stores.registry import detect_backend
from .objects import ROOT_ATTR, object_bytes, parse_objects
from .writer import path_string


class StorageReader(storage.StorageReader):
    """Reads a lean_store checkpoint at ``path`` for ``dcp.load``. ``allow_pickle``: unpickle
    non-tensor values that a writer stored pickled (only for checkpoints you trust)."""

    def __init__(self, path: str | os.PathLike | None = None, *, allow_pickle: bool = False
                 ) -> None:
        super().__init__()
        self.path = None if path is None else path_string(path)
        self.allow_pickle = bool(allow_pickle)
        self.load_id = uuid.uuid4().hex
        self._ck: Checkpoint | None = None
        self._objects: dict[str, dict] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.close()
        if checkpoint_id is not None:
            self.path = path_string(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            detect_backend(path_string(checkpoint_id))
        except (CheckpointError, OSError):
            return False
        return True

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def _open(self) -> Checkpoint:
        if self._ck is None:
            if self.path is None:
                raise CheckpointError(
                    "lean_store.interop.dcp.StorageReader needs a path (or checkpoint_id)")
            ck = Checkpoint(self.path)
            try:
                self._objects = parse_objects(ck.root_attrs.get(ROOT_ATTR), str(self.path))
            except BaseException:
                ck.close()
                raise
            self._ck = ck
        return self._ck

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        ck = self._open()
        meta: dict[str, Any] = {}
        for entry in ck.layout:
            dtype = dtype_of_format(entry.format)
            if dtype is None:
                continue  # a lean_store format torch has no dtype for: not offered to DCP
            meta[entry.name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype),
                size=torch.Size(entry.shape),
                chunks=[_chunk(entry, box) for box in _stored_boxes(ck, entry)],
            )
        for key in self._objects:
            meta[key] = BytesStorageMetadata()
        return Metadata(
            state_dict_metadata=meta,
            storage_meta=StorageMeta(checkpoint_id=self.path, load_id=self.load_id),
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self._open()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        ck = self._open()
        try:
            for item in plan.items:
                key = item.storage_index.fqn
                if item.type == LoadItemType.BYTE_IO:
                    record = self._objects.get(key)
                    if record is None:
                        raise CheckpointError(f"{self.path}: no stored value {key!r}")
                    planner.load_bytes(item, object_bytes(key, record, self.allow_pickle))
                    continue
                entry = ck.layout[key]
                region = _region(entry, item.storage_index.offset, item.storage_offsets,
                                 item.lengths)
                shape = tuple(int(n) for n in item.lengths)
                dest = planner.resolve_tensor(item).detach()
                if tuple(dest.shape) != shape:
                    raise CheckpointError(
                        f"tensor {key!r}: destination of shape {tuple(dest.shape)} for a read of "
                        f"{shape}"
                    )
                out = _words_of(dest, entry.format)
                words = _read(ck, key, region, out)
                if out is None:
                    dest.copy_(new_tensor(words, entry.format, shape, "cpu"))
                planner.commit_tensor(item, dest)
        finally:
            self.close()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def close(self) -> None:
        if self._ck is not None:
            self._ck.close()
            self._ck = None


def _words_of(dest: torch.Tensor, fmt: Any) -> Any:
    """A numpy view of ``dest``'s bits to read straight into, when ``dest`` is a contiguous
    CPU tensor of the stored format (None: read, then copy with torch's casting rules)."""
    if (dest.device.type != "cpu" or not dest.is_contiguous() or dest.is_complex()
            or dest.dtype == torch.bool or fmt.words_per_value != 1
            or dtype_of_format(fmt) != dest.dtype):
        return None
    flat = dest.reshape(-1) if dest.dim() == 0 else dest
    return bit_view(flat).numpy().view(fmt.storage_dtype)


def _read(ck: Checkpoint, key: str, region: tuple[slice, ...], out: Any = None) -> Any:
    """Raw words of ``region``, every chunk it touches checked (a sharded HDF5 checkpoint reads
    it from the one shard file that holds it; DCP reads never cross a stored shard)."""
    return ck.read_region(key, region, out)


def _stored_boxes(ck: Checkpoint, entry: Entry) -> list[Any]:
    from ...distributed.shard_spec import Box

    shards = ck.shards(entry.name)
    if shards:
        return [s.box for s in shards if not s.box.empty]
    return [Box.whole(entry.shape or (1,))]


def _chunk(entry: Entry, box: Any) -> ChunkStorageMetadata:
    if not entry.shape:
        return ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))
    return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.lengths))


def _region(entry: Entry, chunk_offsets: Any, offsets: Any, lengths: Any
            ) -> tuple[slice, ...]:
    """The global region of a read: the stored chunk's offset plus the offset inside it."""
    if not entry.shape:
        return (slice(0, 1),)
    base = tuple(int(o) for o in (chunk_offsets or (0,) * len(entry.shape)))
    return tuple(slice(b + int(o), b + int(o) + int(n))
                 for b, o, n in zip(base, offsets, lengths))
