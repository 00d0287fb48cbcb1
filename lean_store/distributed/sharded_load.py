"""Sharded load with resharding: a checkpoint saved by N ranks (or by one process) loads into
M ranks with any Shard/Replicate placement. Each rank reads only the parts of the stored shards
that intersect its own boxes.

Stages, each closed by an agreement so every rank raises the same error and none installs
anything unless all can:

1. validate: header, layout against the target, recorded shards cover every tensor exactly
   once (done when the checkpoint is opened), the master file's mappings;
2. verify (``verify=True``): every stored shard's digest, each shard checked by one rank
   (round robin), so the whole checkpoint is read once in total across ranks;
3. install: each rank reads the intersections of its boxes with the stored shards, in bounded
   blocks, and copies them into its local tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..chunking import DEFAULT_CHUNK_BYTES, iter_regions, plan_chunks
from ..errors import CheckpointError
from ..stores.hdf5.sharded import deferred_source_checks
from .collective import Collective, stage
from .dtensor_blocks import check_target_cover
from .local_state import Piece, layout_of, local_pieces, strided_boxes
from .shard_spec import Box, reads_for

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint


def stored_boxes(ck: Checkpoint, name: str) -> list[Box]:
    shards = ck.shards(name)
    if shards:
        return [s.box for s in shards]
    entry = ck.layout[name]
    return [Box.whole(entry.shape or (1,))]


def _verify_units(ck: Checkpoint, names: list[str]) -> list[tuple[str, int | None]]:
    """(name, shard number) of every stored shard; (name, None) for a tensor saved whole."""
    units: list[tuple[str, int | None]] = []
    for name in names:
        count = len(ck.shards(name))
        units.extend((name, k) for k in range(count)) if count else units.append((name, None))
    return units


def plan_reads(piece: Piece, stored: list[Box]) -> list[Box]:
    """The regions this rank reads for one tensor: its box cut by the stored shards."""
    return [] if piece.box.empty else reads_for(piece.box, stored)


def load(
    target: Any,
    path: Any,
    *,
    process_group: Any = None,
    strict: bool = True,
    verify: bool = True,
    block_bytes: int = DEFAULT_CHUNK_BYTES,
    strict_order: bool = False,
) -> Any:
    """Load into this rank's shards of ``target`` (all ranks of the group must call this);
    tensors match by name, and ``strict_order=True`` also requires ``target``'s order."""
    from ..checkpoint import Checkpoint, LoadResult, warn_skipped

    comm = Collective(process_group)
    ck = None
    pieces: list[Piece] = []
    names: list[str] = []
    result = LoadResult()
    try:
        with stage(comm) as st:  # 1. validate
            pieces = local_pieces(target)
            expected = layout_of(pieces)
            with deferred_source_checks():  # HDF5: each rank checks the shard files it reads
                ck = Checkpoint(path)
            ck.layout.check(expected, allow_missing=not strict, allow_extra=not strict,
                            order_matters=strict_order)
            names = [n for n in expected.names() if n in ck.layout]
            result = LoadResult(
                missing=[n for n in expected.names() if n not in ck.layout],
                unexpected=[n for n in ck.layout.names() if n not in expected],
            )
            check_planned_reads(ck, pieces, names)  # before anything is installed
            st.share(strided_boxes(pieces))
        check_target_cover(st.shared)
        assert ck is not None
        if verify:  # 2. verify
            verify_shards(ck, names, comm)
        with stage(comm):  # 3. install
            by_name = {p.name: p for p in pieces}
            for name in names:
                install_piece(ck, by_name[name], stored_boxes(ck, name), block_bytes)
                result.loaded.append(name)
    finally:
        if ck is not None:
            ck.close()
    warn_skipped(result)
    return result


def check_planned_reads(ck: Checkpoint, pieces: list[Piece], names: list[str]) -> None:
    """Have the store check everything this rank's reads will touch (the source datasets of a
    sharded HDF5 checkpoint opened with deferred checks) before anything is installed."""
    by_name = {p.name: p for p in pieces}
    for name in names:
        for part in plan_reads(by_name[name], stored_boxes(ck, name)):
            ck.check_region(name, part)


def verify_shards(ck: Checkpoint, names: list[str], comm: Collective) -> None:
    """Check every stored shard's digest of ``names``, each shard by one rank, round robin;
    every rank raises if any rank found a problem."""
    units = _verify_units(ck, names)
    with stage(comm):
        for name, k in units[comm.rank :: comm.size]:
            for _ in ck.blocks(name, shard=k, reuse=True):
                pass
    for i, (name, k) in enumerate(units):  # what another rank checked whole: not again here
        if k is not None and i % comm.size != comm.rank:
            ck.checked_elsewhere(name, k)


def install_piece(ck: Checkpoint, piece: Piece, stored: list[Box], block_bytes: int) -> None:
    entry = ck.layout[piece.name]
    if entry.format != piece.format:  # the layout check makes this unreachable
        raise CheckpointError(f"{piece.name!r}: format differs from the checkpoint")
    target = piece.target()
    itemsize = entry.format.storage_dtype.itemsize * entry.format.words_per_value
    for part in plan_reads(piece, stored):
        unit = plan_chunks(part.lengths, itemsize, block_bytes)
        for local in iter_regions(part.lengths, unit):
            region = tuple(slice(s.start + o, s.stop + o) for s, o in zip(local, part.offsets))
            words = ck.read_region(piece.name, region)
            target.write(piece.box.local(region), words)
