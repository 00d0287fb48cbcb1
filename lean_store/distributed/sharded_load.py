"""Sharded load with resharding: a checkpoint saved by N ranks (or by one process) loads into
M ranks with any Shard/Replicate placement. Each rank reads only the parts of the stored shards
that intersect its own boxes.

Stages, each closed by an agreement so every rank raises the same error and none installs
anything unless all can:

1. validate: header, layout against the target, recorded shards cover every tensor exactly
   once (done when the checkpoint is opened), the master file's mappings;
2. verify (``verify=True``): every stored shard's digest, each shard checked by one rank, so
   the whole checkpoint is read once in total across ranks. A shard goes to a rank whose own
   box holds all of it where there is one (the least loaded such rank), else to the least
   loaded rank; that rank keeps the verified words (up to :data:`KEPT_BYTES`) and installs
   them from memory, so a same-placement load reads each shard once and a rank opens only what
   it installs;
3. install: each rank reads the intersections of its boxes with the stored shards, in bounded
   blocks, and copies them into its local tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..chunking import DEFAULT_CHUNK_BYTES, Region, iter_regions, plan_chunks
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


KEPT_BYTES = 64 << 20
"""Verified shard words a rank keeps in memory to install without reading them again."""
UNIT_COST = 64 << 10
"""The fixed cost of verifying one shard, in bytes of reading, when balancing ranks' shares."""

Unit = tuple[str, "int | None", Box]


def _verify_units(ck: Checkpoint, names: list[str]) -> tuple[list[Unit], list[int]]:
    """(name, shard number, box) of every stored shard, (name, None, whole box) for a tensor
    saved whole; and the positions of the units whose checker also checks the tensor's
    metadata (one per tensor, the ``i``-th tensor's ``i % shards``-th shard: spread over the
    checking ranks)."""
    units: list[Unit] = []
    metadata: list[int] = []
    for i, name in enumerate(names):
        shards = ck.shards(name)
        metadata.append(len(units) + (i % len(shards) if shards else 0))
        if shards:
            units.extend((name, k, s.box) for k, s in enumerate(shards))
        else:
            units.append((name, None, stored_boxes(ck, name)[0]))
    return units, metadata


def _holds(outer: Box | None, inner: Box) -> bool:
    return outer is not None and all(
        o <= i and i + n <= o + m
        for o, m, i, n in zip(outer.offsets, outer.lengths, inner.offsets, inner.lengths))


def assign_verifiers(units: list[Unit], itemsizes: dict[str, int],
                     holders: list[dict[str, Box]]) -> list[int]:
    """The rank that checks each unit: among the ranks whose box holds the whole unit (they
    read it anyway to install it), else among all ranks, the one with the least bytes assigned
    so far (lowest rank on ties). Pure: every rank computes the same list."""
    load = [0] * len(holders)
    everyone = range(len(holders))
    out = []
    for name, _k, box in units:
        fit = [r for r in everyone if _holds(holders[r].get(name), box)] or everyone
        rank = min(fit, key=lambda r: (load[r], r))
        load[rank] += box.size * itemsizes[name] + UNIT_COST
        out.append(rank)
    return out


def _boxes_json(pieces: list[Piece], names: list[str]) -> dict[str, list[list[int]]]:
    wanted = set(names)
    return {p.name: [list(p.box.offsets), list(p.box.lengths)] for p in pieces
            if p.name in wanted and not p.box.empty}


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
            # before anything is installed (with verify, each tensor's metadata is checked by
            # one rank in the verify stage)
            check_planned_reads(ck, pieces, names, metadata=not verify)
            st.share({"strided": strided_boxes(pieces), "boxes": _boxes_json(pieces, names)})
        check_target_cover([report["strided"] for report in st.shared])
        holders = [{n: Box.of(*b) for n, b in report["boxes"].items()} for report in st.shared]
        assert ck is not None
        kept: dict[tuple[str, Box], list[tuple[Region, Any]]] = {}
        if verify:  # 2. verify
            kept = verify_shards(ck, names, comm, holders)
        with stage(comm):  # 3. install
            by_name = {p.name: p for p in pieces}
            for name in names:
                install_piece(ck, by_name[name], stored_boxes(ck, name), block_bytes, kept)
                result.loaded.append(name)
    finally:
        if ck is not None:
            ck.close()
    warn_skipped(result)
    return result


def check_planned_reads(ck: Checkpoint, pieces: list[Piece], names: list[str],
                        metadata: bool = True) -> None:
    """Have the store check everything this rank's reads will touch (the source datasets of a
    sharded HDF5 checkpoint opened with deferred checks) before anything is installed;
    ``metadata``: each read tensor's own metadata too (else the verify stage checks it)."""
    by_name = {p.name: p for p in pieces}
    for name in names:
        parts = plan_reads(by_name[name], stored_boxes(ck, name))
        if parts and metadata:
            ck.check_metadata(name)
        for part in parts:
            ck.check_region(name, part)


def verify_shards(ck: Checkpoint, names: list[str], comm: Collective,
                  holders: list[dict[str, Box]] | None = None
                  ) -> dict[tuple[str, Box], list[tuple[Region, Any]]]:
    """Check every stored shard's digest of ``names``, each shard by one rank (see
    :func:`assign_verifiers`; ``holders``: every rank's box per name, default none); every rank
    raises if any rank found a problem. Returns the verified blocks this rank keeps to install
    (shards its own box holds, up to :data:`KEPT_BYTES`), by (name, shard box)."""
    units, metadata = _verify_units(ck, names)
    with_metadata = set(metadata)
    holders = holders if holders is not None else [{} for _ in range(comm.size)]
    itemsizes = {n: ck.layout[n].format.storage_dtype.itemsize
                 * ck.layout[n].format.words_per_value for n in names}
    ranks = assign_verifiers(units, itemsizes, holders)
    mine = holders[comm.rank]
    kept: dict[tuple[str, Box], list[tuple[Region, Any]]] = {}
    room = KEPT_BYTES
    with stage(comm):
        for i, ((name, k, box), rank) in enumerate(zip(units, ranks)):
            if rank != comm.rank:
                continue
            if i in with_metadata:  # the tensor's own metadata, for every rank
                ck.check_metadata(name)
            keep = _holds(mine.get(name), box) and box.size * itemsizes[name] <= room
            blocks = list(ck.blocks(name, shard=k)) if keep else None
            if blocks is None:
                for _ in ck.blocks(name, shard=k, reuse=True):
                    pass
                continue
            kept[name, box] = blocks  # whole: every chunk and the digest checked
            room -= box.size * itemsizes[name]
    for i, ((name, k, _box), rank) in enumerate(zip(units, ranks)):
        if rank == comm.rank:  # checked by another rank: not again here
            continue
        if k is not None:
            ck.checked_elsewhere(name, k)
        if i in with_metadata:
            ck.metadata_checked_elsewhere(name)
    return kept


def install_piece(ck: Checkpoint, piece: Piece, stored: list[Box], block_bytes: int,
                  kept: dict[tuple[str, Box], list[tuple[Region, Any]]] | None = None) -> None:
    entry = ck.layout[piece.name]
    if entry.format != piece.format:  # the layout check makes this unreachable
        raise CheckpointError(f"{piece.name!r}: format differs from the checkpoint")
    target = piece.target()
    itemsize = entry.format.storage_dtype.itemsize * entry.format.words_per_value
    for part in plan_reads(piece, stored):
        blocks = (kept or {}).get((piece.name, part))
        if blocks is not None:  # verified whole by this rank: from memory
            for region, words in blocks:
                target.write(piece.box.local(region), words)
            continue
        unit = plan_chunks(part.lengths, itemsize, block_bytes)
        for local in iter_regions(part.lengths, unit):
            region = tuple(slice(s.start + o, s.stop + o) for s, o in zip(local, part.offsets))
            words = ck.read_region(piece.name, region)
            target.write(piece.box.local(region), words)
