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

import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any

from ..chunking import DEFAULT_CHUNK_BYTES
from ..errors import CheckpointError
from ..layout import Layout
from ..metadata import root_attrs
from ..options import SaveOptions, refuse
from ..progress import make_progress
from ..snapshot import snapshot_of
from ..stores.commit import Commit
from ..stores.registry import backend_for, backend_record
from ..stores.sharded_layout import ShardedLayout
from .collective import Collective, stage
from .local_state import Piece, local_pieces
from .plan import TensorPlan, collect_digests, describe, make_plan, shard_records
from .shard_spec import ChunkPlan

SHARDED_VERSION = 1


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

    # 1. describe
    pieces: list[Piece] = []
    shards: ShardedLayout | None = None
    with stage(comm) as st:
        shards = backend_record(backend_for(path, backend)).sharded()
        shards.check_target(path)
        pieces = state.pieces() if isinstance(state, FrozenPieces) else local_pieces(state)
        if not pieces:
            raise CheckpointError("nothing to save: the state has no tensors")
        st.share(describe(pieces))
    assert shards is not None
    # 2. plan: every rank computes it from the same descriptions, so a bad plan raises the
    # same error on every rank without another agreement round
    layout, plans = make_plan(st.shared)
    chunks = shards.chunk_plans(plans, chunk_bytes)

    # 3. prepare (rank 0)
    location: Commit | None = None
    with stage(comm) as st:
        if comm.rank == 0:
            location = Commit.at(path, directory=True)
            location.make_directory()
            shards.prepare(location.work, plans, chunks, compression)
            st.share(location.work)
    try:
        work = st.shared[0]
        # 4. write: each rank its own shards
        owned = sum(box.size * p.entry.format.words_per_value
                    * p.entry.format.storage_dtype.itemsize
                    for p in plans for _, box in p.owned(comm.rank))
        label = f"save {Path(str(path)).name} (rank {comm.rank})"
        with stage(comm) as st, make_progress(options.progress, label, owned) as bar:
            st.share(_write_shards(comm, shards, work, plans, chunks, pieces, chunk_bytes,
                                   compression, bar))
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
                shards.finish(work, comm.size, plans, records, attrs, chunk_bytes)
                location.commit()
    except BaseException:
        shards.abort()  # before the work directory goes: the master may still be open
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
    a ``checksum`` other than the one its backend's sharded layout writes. HDF5 shard files
    always keep HDF5's fletcher32 filter besides the CRC-32C table (whole tensors are read
    through the master's virtual datasets, where only HDF5's own filter is checked); Zarr's
    chunk checksum is its crc32c codec."""
    refuse(options, REFUSED, "sharded saves")
    backend = backend_for(path, backend)
    honoured = backend_record(backend).sharded().checksum
    if options.checksum not in (None, honoured):
        raise CheckpointError(
            f"save option checksum={options.checksum!r} is not supported by sharded {backend} "
            f"saves; they use {honoured!r}"
        )


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


def _counted(piece: Piece, bar: Any) -> Any:
    """Reads of ``piece``'s local tensor that also advance the progress bar by their bytes."""
    source = piece.source()

    def read(region: Any) -> Any:
        bits = source.read(region)
        bar.advance(bits.nbytes)
        return bits

    return read


def _write_shards(comm: Collective, shards: ShardedLayout, work: str, plans: list[TensorPlan],
                  chunks: list[ChunkPlan | None], pieces: list[Piece], chunk_bytes: int,
                  compression: Any, bar: Any) -> dict[str, list[Any]]:
    """This rank's shards, through its backend's rank writer. Tensors whose shards share
    chunks (a Zarr chunk straddling two shards) are written in turns, rank by rank, so every
    read-modify-write of a shared chunk sees the previous rank's data."""
    digests: dict[str, list[Any]] = {}
    alone = [(i, k, box) for i, (plan, cp) in enumerate(zip(plans, chunks))
             if cp is None or cp.aligned for k, box in plan.owned(comm.rank)]
    in_turns = [i for i, cp in enumerate(chunks) if cp is not None and not cp.aligned]

    def write(owned: list[tuple[int, int, Any]]) -> None:
        if not owned:
            return
        with shards.rank_writer(work, comm.rank, comm.size, chunk_bytes, compression) as writer:
            for i, k, box in owned:
                crc, unit = writer.write(plans[i], chunks[i], k, box, _counted(pieces[i], bar))
                digests[f"{i}/{k}"] = [crc, list(unit)]

    write(alone)
    if comm.rank == 0:  # while the other ranks still write their shards
        shards.write_metadata(work, comm.size, plans, chunk_bytes)
    for turn in range(comm.size if in_turns else 0):  # the same on every rank
        with stage(comm):
            if turn == comm.rank:
                write([(i, k, box) for i in in_turns for k, box in plans[i].owned(comm.rank)])
    return digests
