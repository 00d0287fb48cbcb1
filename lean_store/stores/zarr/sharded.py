"""Zarr sharded save: one array per tensor; rank 0 creates the metadata, every rank writes only
the chunks of the shards it owns, straight into the shared store.

Chunks come from :func:`aligned_chunks`: a chunk shape dividing every shard boundary, so no
chunk is shared by two ranks and all ranks write concurrently. When the shards would force
tiny chunks, ordinary chunks are used and the ranks write that tensor in turns (each write is
then a read-modify-write of the chunks it touches), which is slower but never loses data.

Local, uncompressed stores (the default) skip zarr's metadata calls (~1.5 ms a tensor, most of
it zarr's event-loop hand-offs), as single-process saves do: rank 0 writes each array's
``zarr.json`` itself (``zarr_compat.plain_array_document``, byte for byte what ``create_array``
writes), every rank writes whole chunk files with ``zarr_direct.DirectWriter``, and the commit
writes every array's final document and the consolidated root once, from the documents in hand.
Which path a store takes is read from what rank 0 wrote (the array documents' codecs), so
every rank and every caller (``ls.save``, the DCP backend) decides alike.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from ...chunking import DEFAULT_CHUNK_BYTES, plan_chunks
from ...distributed.plan import TensorPlan
from ...distributed.shard_spec import Box, ChunkPlan, aligned_chunks
from ...errors import CheckpointError
from ...metadata import tensor_attrs
from ...naming import node_name
from .. import sharded_layout
from ..commit import is_url
from ..sharded_layout import RankShardWriter, ShardedLayout
from .checks import check_root_size
from .chunk_keys import CHUNK_KEY_ENCODING
from .compat import (
    consolidated_group_document,
    encoded_document,
    json_document_bytes,
    plain_array_document,
    writing_empty_chunks,
)
from .direct_write import DirectWriter, direct_ok
from .store import (
    ZarrTensorWriter,
    _plain,
    compressors_for,
    dimension_names,
    mark_complete,
    native_dtype,
    storage_name_of,
    stored_shape,
)
from .url import open_url_store

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


def _store(root: str) -> Any:
    """What zarr opens: a local path as is, a URL as an fsspec store (fsspec options from the
    environment; zarr releases differ in what they do with ``storage_options`` themselves)."""
    return open_url_store(root, read_only=False) if is_url(root) else root


def create_arrays(
    root: str, plans: list[TensorPlan], chunks: list[ChunkPlan], compression: Any
) -> None:
    """Rank 0: the group and every array's metadata (no data, no root attributes yet)."""
    if not is_url(root) and compression in (None, False):
        docs = [array_document(plan, cp) for plan, cp in zip(plans, chunks)]
        if all(doc is not None for doc in docs):
            write_documents(Path(root), plans, docs)
            return
    group = zarr.open_group(store=_store(root), mode="w-", zarr_format=3)
    compressors = compressors_for(compression)
    for plan, cp in zip(plans, chunks):
        entry = plan.entry
        shape = stored_shape(entry)
        pair = shape[len(plan.stored_shape):]
        attrs = tensor_attrs(entry, storage_name_of(entry.format))
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
            chunk_key_encoding=CHUNK_KEY_ENCODING,  # c.0.0, as the direct writer's
            config={"write_empty_chunks": True},  # all-zero chunks are written too
        )


def open_writer(root: str, plan: TensorPlan, cp: ChunkPlan) -> ZarrTensorWriter:
    """Any rank: a writer for the chunks of one tensor (metadata is never rewritten)."""
    if cp.aligned and not is_url(root):
        doc = read_document(Path(root), plan)
        if direct_ok(doc) and _leading_edge_only(doc):  # whole chunk files, no zarr
            chunks = tuple(doc["chunk_grid"]["configuration"]["chunk_shape"])
            entry = plan.entry
            itemsize = (native_dtype(entry.format) or entry.format.storage_dtype).itemsize
            array_dir = Path(root) / node_name(entry.name)
            writer = DirectWriter(array_dir, doc, chunks, None, itemsize)
            return ZarrTensorWriter(doc, entry, cp.chunks, cp.chunks, writer)
    array = zarr.open_array(
        store=_store(root), path=node_name(plan.entry.name), mode="r+", zarr_format=3)
    array = writing_empty_chunks(array)
    return ZarrTensorWriter(array, plan.entry, cp.chunks, cp.chunks)


def finish(root: str, plans: list[TensorPlan], records: list[str], root_attrs: dict[str, Any]
           ) -> None:
    """Rank 0, after every rank succeeded: shard records per array, the root attributes, then
    the root ``zarr.json`` with consolidated metadata and ``complete`` written last (the commit
    marker on object stores)."""
    if not is_url(root):
        docs = [read_document(Path(root), plan) for plan in plans]
        if all(direct_ok(doc) for doc in docs):
            finish_documents(Path(root), plans, docs, records, root_attrs)
            return
    group = zarr.open_group(store=_store(root), mode="r+", zarr_format=3)
    for plan, shards in zip(plans, records):
        array = group[node_name(plan.entry.name)]
        array.attrs.update({"shards": shards})
    group.attrs.update(_plain(root_attrs))
    mark_complete(group)  # one write: consolidated metadata and complete, last


GROUP_DOCUMENT = {"attributes": {}, "zarr_format": 3, "consolidated_metadata": None,
                  "node_type": "group"}
"""The root ``zarr.json`` zarr's ``open_group(mode="w-")`` writes for a new, empty group."""

MAX_DOCUMENT_BYTES = 1 << 24  # an array's own zarr.json as rank 0 wrote it, read back


def array_document(plan: TensorPlan, cp: ChunkPlan) -> dict[str, Any] | None:
    """The ``zarr.json`` of one uncompressed tensor before its shards are recorded, exactly
    as :func:`create_arrays`' ``create_array`` call writes it (None: a data type only zarr
    describes)."""
    entry = plan.entry
    shape = stored_shape(entry)
    pair = shape[len(plan.stored_shape):]
    attrs = _plain(tensor_attrs(entry, storage_name_of(entry.format)))
    dtype = native_dtype(entry.format) or entry.format.storage_dtype
    return plain_array_document(shape, dtype, cp.chunks + pair, None, attrs,
                                dimension_names(entry))


def write_documents(root: Path, plans: list[TensorPlan], docs: list[Any]) -> None:
    """Rank 0: the empty group's and every array's ``zarr.json``, as zarr writes them."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "zarr.json").write_bytes(json_document_bytes(GROUP_DOCUMENT))
    for plan, doc in zip(plans, docs):
        array_dir = root / node_name(plan.entry.name)
        array_dir.mkdir(parents=True, exist_ok=True)
        (array_dir / "zarr.json").write_bytes(json_document_bytes(doc))


def read_document(root: Path, plan: TensorPlan) -> dict[str, Any]:
    """One array's ``zarr.json`` as rank 0 wrote it into the work directory."""
    path = root / node_name(plan.entry.name) / "zarr.json"
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_DOCUMENT_BYTES + 1)
        doc = json.loads(text) if len(text) <= MAX_DOCUMENT_BYTES else None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable array metadata ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("attributes"), dict):
        raise CheckpointError(f"{path}: not an array's metadata document")
    return doc


def _leading_edge_only(doc: dict[str, Any]) -> bool:
    """True when only the first axis can end in a partial chunk: a partial chunk's bytes are
    then a prefix of the full chunk's, which is how DirectWriter pads it."""
    shape = doc["shape"]
    chunks = doc["chunk_grid"]["configuration"]["chunk_shape"]
    return all(d % c == 0 for d, c in zip(shape[1:], chunks[1:]))


def finish_documents(root: Path, plans: list[TensorPlan], docs: list[dict[str, Any]],
                     records: list[str], root_attrs: dict[str, Any]) -> None:
    """Rank 0: every array's final ``zarr.json`` (its shard records added, as zarr's attribute
    update writes it), then the root with the consolidated copies and ``complete``, once."""
    written: dict[str, Any] = {}
    for plan, doc, shards in zip(plans, docs, records):
        node = node_name(plan.entry.name)
        final = {**doc, "attributes": {**doc["attributes"], "shards": shards}}
        text = encoded_document(final)  # encoded once: this file, and the root's copy
        (root / node / "zarr.json").write_bytes(text.encode())
        written[node] = text
    try:
        with open(root / "zarr.json", "rb") as f:  # this save's own, written by rank 0
            group = json.loads(f.read())
        attrs = dict(group["attributes"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{root}: unreadable group metadata ({exc})") from None
    attrs = {**attrs, **_plain(root_attrs), "complete": True}
    (root / "zarr.json").write_bytes(json_document_bytes(
        consolidated_group_document(attrs, written)))
    check_root_size(root, written)


class _ZarrRankWriter(RankShardWriter):
    def __init__(self, root: str) -> None:
        self._root = root
        self._sinks: dict[int, ZarrTensorWriter] = {}  # tensor index -> its array, opened once

    def write(self, plan: TensorPlan, chunk: ChunkPlan | None, k: int, box: Box,
              read: Callable[[tuple[slice, ...]], np.ndarray]) -> tuple[int, tuple[int, ...]]:
        assert chunk is not None
        unit = chunk.chunks
        if not chunk.aligned:  # shared chunks: the caller takes turns; units of about 4 MiB
            unit = plan_chunks(box.lengths, plan.entry.format.storage_dtype.itemsize,
                               DEFAULT_CHUNK_BYTES)
        sink = self._sinks.get(plan.entry.index)
        if sink is None:  # a rank may own several shards of one tensor
            sink = self._sinks[plan.entry.index] = open_writer(self._root, plan, chunk)
        return sharded_layout.write_box(read, box, unit, sink.write), tuple(unit)


class ZarrShardedLayout(ShardedLayout):
    """One array per tensor; every rank writes the chunks of its shards into it."""

    checksum = CHECKSUM

    def chunk_plans(self, plans: list[TensorPlan], chunk_bytes: int, *,
                    always_aligned: bool = False) -> list[ChunkPlan | None]:
        return [chunk_plan(p, chunk_bytes, always_aligned=always_aligned) for p in plans]

    def prepare(self, work: str, plans: list[TensorPlan], chunks: list[ChunkPlan | None],
                compression: Any) -> None:
        aligned = [c for c in chunks if c is not None]
        assert len(aligned) == len(plans)
        create_arrays(work, plans, aligned, compression)

    def rank_writer(self, work: str, rank: int, world: int, chunk_bytes: int,
                    compression: Any) -> RankShardWriter:
        return _ZarrRankWriter(work)

    def finish(self, work: str, world: int, plans: list[TensorPlan], records: list[str],
               root_attrs: dict[str, Any], chunk_bytes: int) -> None:
        finish(work, plans, records, root_attrs)
