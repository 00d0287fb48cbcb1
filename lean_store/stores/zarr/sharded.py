"""Zarr sharded save: one array per tensor; rank 0 creates the metadata, every rank writes only
the chunks of the shards it owns, straight into the shared store.

Chunks come from :func:`aligned_chunks`: a chunk shape dividing every shard boundary, so no
chunk is shared by two ranks and all ranks write concurrently. When the shards would force
tiny chunks, ordinary chunks are used and the ranks write that tensor in turns (each write is
then a read-modify-write of the chunks it touches), which is slower but never loses data.
"""

from __future__ import annotations

from typing import Any

import zarr

from ...distributed.location import is_url, storage_options_for
from ...distributed.plan import TensorPlan
from ...distributed.shard_spec import ChunkPlan, aligned_chunks
from ...metadata import tensor_attrs
from ...naming import node_name
from ...writing import storage_name
from .store import (
    ZarrTensorWriter,
    _plain,
    compressors_for,
    dimension_names,
    mark_complete,
    native_dtype,
    stored_shape,
)

CHECKSUM = "crc32c"
"""The chunk checksum codec (the ``checksum`` save option a sharded save honours)."""


def chunk_plan(plan: TensorPlan, chunk_bytes: int, *, always_aligned: bool = False) -> ChunkPlan:
    """The chunk shape of one tensor. ``always_aligned``: never give up alignment, however small
    the chunks (for writers that cannot take turns, such as the DCP backend)."""
    fmt = plan.entry.format
    itemsize = (native_dtype(fmt) or fmt.storage_dtype).itemsize
    if fmt.words_per_value == 2 and native_dtype(fmt) is None:
        itemsize *= 2
    boxes = [box for box, _ in plan.shards]
    return aligned_chunks(plan.stored_shape, boxes, itemsize, chunk_bytes,
                          min_chunk_bytes=0 if always_aligned else 1024)


def _options(root: str) -> dict[str, Any]:
    return {"storage_options": storage_options_for(root)} if is_url(root) else {}


def create_arrays(
    root: str, plans: list[TensorPlan], chunks: list[ChunkPlan], compression: Any
) -> None:
    """Rank 0: the group and every array's metadata (no data, no root attributes yet)."""
    group = zarr.open_group(store=root, mode="w-", zarr_format=3, **_options(root))
    compressors = compressors_for(compression)
    for plan, cp in zip(plans, chunks):
        entry = plan.entry
        shape = stored_shape(entry)
        pair = shape[len(plan.stored_shape):]
        attrs = tensor_attrs(entry, storage_name(entry, "zarr"))
        group.create_array(
            node_name(entry.name),
            shape=shape,
            dtype=native_dtype(entry.format) or entry.format.storage_dtype,
            chunks=cp.chunks + pair,
            compressors=compressors,
            filters=None,
            fill_value=0,
            attributes=_plain(attrs),
            dimension_names=dimension_names(entry),
            config={"write_empty_chunks": True},  # all-zero chunks are written too
        )


def open_writer(root: str, plan: TensorPlan, cp: ChunkPlan) -> ZarrTensorWriter:
    """Any rank: a writer for the chunks of one tensor (metadata is never rewritten)."""
    array = zarr.open_array(
        store=root, path=node_name(plan.entry.name), mode="r+", zarr_format=3, **_options(root)
    ).with_config({"write_empty_chunks": True})
    return ZarrTensorWriter(array, plan.entry, cp.chunks, cp.chunks)


def finish(root: str, plans: list[TensorPlan], records: list[str], root_attrs: dict[str, Any]
           ) -> None:
    """Rank 0, after every rank succeeded: shard records per array, the root attributes, then
    the root ``zarr.json`` with consolidated metadata and ``complete`` written last (the commit
    marker on object stores)."""
    group = zarr.open_group(store=root, mode="r+", zarr_format=3, **_options(root))
    for plan, shards in zip(plans, records):
        array = group[node_name(plan.entry.name)]
        array.attrs.update({"shards": shards})
    group.attrs.update(_plain(root_attrs))
    mark_complete(group)  # one write: consolidated metadata and complete, last
