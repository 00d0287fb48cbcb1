"""Sharded save: every rank writes its own shards straight into the shared store.

Stages, each closed by an agreement (an all-gather of outcomes, so every rank raises the same
error if any rank failed and nothing is left half-visible):

1. describe: each rank's layout and box per tensor;
2. plan: same layout everywhere, distinct shards cover each tensor exactly once, owners of
   replicas = lowest rank holding them (computed identically on every rank);
3. prepare: rank 0 creates the work root (hidden temporary directory, or the new URL prefix)
   and, for Zarr, every array's metadata;
4. write: each rank writes the shards it owns, with a crc32c digest per shard;
5. commit: rank 0 records shards and digests, writes the root attributes with ``complete``
   last and renames the work directory into place; on any failure it removes it instead.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any

from ..chunking import DEFAULT_CHUNK_BYTES, iter_regions, plan_chunks
from ..errors import CheckpointError
from ..integrity import crc32c_update
from ..layout import Layout
from ..metadata import root_attrs
from ..options import SaveOptions, refuse
from ..progress import make_progress
from ..snapshot import snapshot_of
from ..stores.hdf5 import sharded as hdf5_sharded
from ..stores.registry import backend_for
from ..stores.zarr import sharded as zarr_sharded
from .collective import Collective, stage
from .local_state import Piece, local_pieces
from .location import Location
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
    options: SaveOptions | None = None,
    kind: str = "state",
    extra_root: dict[str, Any] | None = None,
) -> Layout:
    """Save sharded state from every rank of ``process_group`` (all ranks must call this).
    ``extra_root``: further root attributes, written by rank 0 (the same on every rank).
    ``state`` may also be :class:`FrozenPieces` (a snapshot taken by a background save).
    Options a sharded save cannot honour (:data:`REFUSED`) raise on every rank."""
    options = options or SaveOptions()
    check_options(path, backend, options)  # the same on every rank: all raise, before agreeing
    comm = Collective(process_group)
    chunk_bytes = DEFAULT_CHUNK_BYTES if options.chunk_bytes is None else options.chunk_bytes
    compression = options.compression

    # 1-2. describe and plan
    pieces: list[Piece] = []
    with stage(comm) as st:
        backend = backend_for(path, backend)
        if backend == "hdf5":
            hdf5_sharded.require_local(path)
        pieces = state.pieces() if isinstance(state, FrozenPieces) else local_pieces(state)
        if not pieces:
            raise CheckpointError("nothing to save: the state has no tensors")
        st.share(describe(pieces))
    descriptions = st.shared
    layout: Layout | None = None
    plans: list[TensorPlan] = []
    with stage(comm):
        layout, plans = make_plan(descriptions)
    assert layout is not None and backend is not None
    chunks = [zarr_sharded.chunk_plan(p, chunk_bytes) for p in plans] if backend == "zarr" else []

    # 3. prepare (rank 0)
    location: Location | None = None
    with stage(comm) as st:
        if comm.rank == 0:
            location = Location.create(path)
            if backend == "zarr":
                zarr_sharded.create_arrays(location.work, plans, chunks, compression)
            st.share(location.work)
    try:
        work = st.shared[0]
        # 4. write: each rank its own shards
        owned = sum(box.size * p.entry.format.words_per_value
                    * p.entry.format.storage_dtype.itemsize
                    for p in plans for _, box in p.owned(comm.rank))
        label = f"save {Path(str(path)).name} (rank {comm.rank})"
        with stage(comm) as st, make_progress(options.progress, label, owned) as bar:
            if backend == "zarr":
                st.share(_write_zarr(comm, work, plans, chunks, pieces, bar))
            else:
                st.share(_write_hdf5(comm, work, plans, pieces, chunk_bytes, compression, bar))
        reports = st.shared
        # 5. commit (rank 0)
        with stage(comm):
            if comm.rank == 0:
                assert location is not None
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
    except BaseException:
        if location is not None:
            location.abort()
        raise
    return layout


REFUSED = ("buffer_bytes", "storage_options")
"""Save options a sharded save cannot honour: each rank reads its shards straight from its
tensors (no pooled host staging buffers to size), and a sharded URL save takes endpoint and
credentials from the environment (``AWS_ENDPOINT_URL``, ...). ``snapshot`` applies to
``blocking=False`` saves (see :class:`FrozenPieces`)."""


def check_options(path: Any, backend: str | None, options: SaveOptions) -> None:
    """Raise for a save option a sharded save of ``path`` cannot honour: :data:`REFUSED`, and
    a ``checksum`` other than the backend's. HDF5 shard files always keep HDF5's fletcher32
    filter besides the CRC-32C table (whole tensors are read through the master's virtual
    datasets, where only HDF5's own filter is checked); Zarr's chunk checksum is its crc32c
    codec."""
    refuse(options, REFUSED, "sharded saves")
    backend = backend_for(path, backend)
    honoured = _SHARDED_STORES[backend].CHECKSUM
    if options.checksum not in (None, honoured):
        raise CheckpointError(
            f"save option checksum={options.checksum!r} is not supported by sharded {backend} "
            f"saves; they use {honoured!r}"
        )


_SHARDED_STORES = {"hdf5": hdf5_sharded, "zarr": zarr_sharded}
"""Each backend's sharded layout module (stores/<backend>/sharded.py)."""


class FrozenPieces:
    """This rank's pieces of a state, copied now for a background save (``snapshot`` mode);
    an error met while copying is raised inside the save's first stage, so every rank agrees."""

    def __init__(self, state: Any, snapshot: str) -> None:
        self._pieces: list[Piece] = []
        self._error: Exception | None = None
        try:
            pieces = local_pieces(state)
            frozen = snapshot_of({str(i): p.local for i, p in enumerate(pieces)}, snapshot)
            self._pieces = [dataclasses.replace(p, local=frozen[str(i)])
                            for i, p in enumerate(pieces)]
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the first stage
            self._error = exc

    def pieces(self) -> list[Piece]:
        if self._error is not None:
            raise self._error
        return self._pieces


def _counted(write: Any, bar: Any) -> Any:
    """``write`` that also advances the progress bar by the bytes written."""
    def counted(region: Any, bits: Any) -> None:
        write(region, bits)
        bar.advance(bits.nbytes)

    return counted


def _write_zarr(comm: Collective, work: str, plans: list[TensorPlan], chunks: list[Any],
                pieces: list[Piece], bar: Any) -> dict[str, list[Any]]:
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
                crc = write_box(pieces[i], box, cp.chunks, _counted(sink.write, bar))
                digests[f"{i}/{k}"] = [crc, list(cp.chunks)]
    if turns:
        digests.update(_write_in_turns(comm, work, turns, pieces, bar))
    return digests


def _write_in_turns(comm: Collective, work: str, turns: list[tuple[int, TensorPlan, Any]],
                    pieces: list[Piece], bar: Any) -> dict[str, list[Any]]:
    """Tensors whose shards share chunks: rank r writes while the others wait, so every
    read-modify-write of a shared chunk sees the previous rank's data."""
    digests: dict[str, list[Any]] = {}
    for turn in range(comm.size):
        with stage(comm):
            if turn == comm.rank:
                for i, plan, cp in turns:
                    owned = plan.owned(comm.rank)
                    sink = zarr_sharded.open_writer(work, plan, cp) if owned else None
                    fmt = plan.entry.format
                    for k, box in owned:
                        assert sink is not None
                        unit = plan_chunks(box.lengths, fmt.storage_dtype.itemsize,
                                           DEFAULT_CHUNK_BYTES)
                        crc = write_box(pieces[i], box, unit, _counted(sink.write, bar))
                        digests[f"{i}/{k}"] = [crc, list(unit)]
    return digests


def _write_hdf5(comm: Collective, work: str, plans: list[TensorPlan], pieces: list[Piece],
                chunk_bytes: int, compression: Any, bar: Any) -> dict[str, list[Any]]:
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
                crc = write_box(pieces[i], box, sink.write_unit, _counted(
                    lambda region, bits, box=box, sink=sink: sink.write(box.local(region), bits),
                    bar))
                sink.close({"crc32c": crc})
                digests[f"{i}/{k}"] = [crc, list(sink.write_unit)]
        writer.commit({"lean_store_shard": json.dumps(
            {"rank": comm.rank, "world_size": comm.size}, separators=(",", ":"))})
    return digests

