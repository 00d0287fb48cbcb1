"""Sharded load with resharding: a checkpoint saved by N ranks (or by one process) loads into
M ranks with any Shard/Replicate placement. Each rank reads only the parts of the stored shards
that intersect its own boxes.

Stages, each closed by an agreement so every rank raises the same error and none installs
anything unless all can:

1. validate: header, layout against the target, recorded shards cover every tensor exactly
   once (done when the checkpoint is opened), the master file's mappings;
2. verify (``verify=True``): every stored shard's digest, each shard checked by one rank, so
   the whole checkpoint is read once in total across ranks, and each tensor's own metadata by
   one rank. A shard goes to a rank whose own box holds all of it where there is one (its
   writer if that is one of them, else the least loaded), else to the least loaded rank; that
   rank keeps the verified words (up to :data:`KEPT_BYTES`) and installs them from memory, and
   sends a small shard that other ranks hold too (up to :data:`SENT_BYTES`: step counts) to
   them in its agreement, each receiver checking it against its digest. So a same-placement
   load reads each shard once, by the rank that wrote it. Everything the install will read
   from the store is checked in this stage too;
3. install: each rank reads the intersections of its boxes with the stored shards, in bounded
   blocks, and copies them into its local tensors.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from ..chunking import DEFAULT_CHUNK_BYTES, Region, iter_regions, plan_chunks
from ..errors import CheckpointError, IntegrityError
from ..gc_pause import collection_paused
from ..integrity import crc32c_update
from ..layout import Layout
from ..sources.module_names import spelled_as
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
    """``inner`` lies inside ``outer``. (One loop: a sharded load asks this thousands of
    times, for every unit and rank.)"""
    if outer is None:
        return False
    for o, m, i, n in zip(outer.offsets, outer.lengths, inner.offsets, inner.lengths):
        if i < o or i + n > o + m:
            return False
    return True


def assign_verifiers(units: list[Unit], itemsizes: dict[str, int],
                     holders: list[dict[str, Box]], writers: list[int | None] | None = None
                     ) -> list[int]:
    """The rank that checks each unit: among the ranks whose box holds the whole unit (they
    read it anyway to install it), else among all ranks: the rank that wrote it (``writers``,
    so a rank opens the files it wrote) if it is one of them, else the one with the least bytes
    assigned so far (lowest rank on ties). Pure: every rank computes the same list."""
    load = [0] * len(holders)
    everyone = range(len(holders))
    out = []
    for i, (name, _k, box) in enumerate(units):
        fit = [r for r in everyone if _holds(holders[r].get(name), box)] or everyone
        writer = None if writers is None else writers[i]
        rank = writer if writer is not None and writer in fit else min(
            fit, key=lambda r: (load[r], r))
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
    tensors match by name, and ``strict_order=True`` also requires ``target``'s order.
    Python's cyclic collector is paused meanwhile (:mod:`.gc_pause`)."""
    with collection_paused():
        return _load(target, path, process_group, strict, verify, block_bytes, strict_order)


def _load(target: Any, path: Any, process_group: Any, strict: bool, verify: bool,
          block_bytes: int, strict_order: bool) -> Any:
    from ..checkpoint import Checkpoint, LoadResult, is_module, warn_skipped

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
            spelling: dict[str, str] = {}
            if is_module(target):  # a module's names as ``ck`` spells them (a wrapper's:
                # sources/module_names.py); every rank has the same names, the same spelling
                spelling = spelled_as([p.name for p in pieces], ck.layout.names())
                if spelling:
                    pieces = [dataclasses.replace(p, name=spelling.get(p.name, p.name))
                              for p in pieces]
                    expected = layout_of(pieces)
            pieces, handed = extra_state_pieces(target, pieces, ck.layout, spelling)
            expected = layout_of(pieces) if handed else expected
            ck.layout.check(expected, allow_missing=not strict, allow_extra=not strict,
                            order_matters=strict_order)
            names = [n for n in expected.names() if n in ck.layout]
            result = LoadResult(
                missing=[n for n in expected.names() if n not in ck.layout],
                unexpected=[n for n in ck.layout.names() if n not in expected],
            )
            if not verify:  # before anything is installed (else in the verify stage)
                check_planned_reads(ck, pieces, names)
            st.share({"strided": strided_boxes(pieces), "boxes": _boxes_json(pieces, names)})
        check_target_cover([report["strided"] for report in st.shared])
        holders = [{n: Box.of(*b) for n, b in report["boxes"].items()} for report in st.shared]
        assert ck is not None
        kept: dict[tuple[str, Box], list[tuple[Region, Any]]] = {}
        if verify:  # 2. verify
            kept = verify_shards(ck, names, comm, holders, pieces)
        with stage(comm):  # 3. install
            by_name = {p.name: p for p in pieces}
            for name in names:
                install_piece(ck, by_name[name], stored_boxes(ck, name), block_bytes, kept)
                result.loaded.append(name)
            if handed:  # a module's extra state, handed to it
                from ..sources.module_state import hand_over

                for name, owner in handed.items():
                    hand_over(owner, name, by_name[name].local)
    finally:
        if ck is not None:
            ck.close()
    warn_skipped(result)
    return result


def extra_state_pieces(target: Any, pieces: list[Piece], stored: Layout,
                       spelling: dict[str, str]) -> tuple[list[Piece], dict[str, Any]]:
    """``pieces`` with each extra-state entry of ``target`` (a module's or a
    :class:`ModuleState`'s, named as ``stored`` spells it) replaced by a new tensor of its stored
    shape and format, which the load fills and then hands to the module
    (sources/module_state.py); and those entries' names -> their modules."""
    from ..checkpoint import is_module

    if getattr(target, "extra_state_owners", None) is None and not is_module(target):
        return pieces, {}
    import torch

    from ..sources.module_state import check_settable, owners_in
    from ..sources.torch_source import dtype_of_format, state_dict_of

    owners = {spelling.get(n, n): m
              for n, m in owners_in(target, state_dict_of(target)).items()}
    handed: dict[str, Any] = {}
    out = []
    for piece in pieces:
        owner = owners.get(piece.name)
        if owner is not None and not piece.sharded and piece.name in stored:
            check_settable(owner, piece.name)
            entry = stored[piece.name]
            dtype = dtype_of_format(entry.format)
            if dtype is None:
                raise CheckpointError(f"extra state {piece.name!r} is stored as "
                                      f"{entry.format.tag}, which torch has no dtype for")
            local = torch.empty(entry.shape, dtype=dtype, device=piece.local.device)
            piece = dataclasses.replace(piece, global_shape=entry.shape, format=entry.format,
                                        box=Box.whole(entry.shape or (1,)), local=local)
            handed[piece.name] = owner
        out.append(piece)
    return out, handed


def check_planned_reads(ck: Checkpoint, pieces: list[Piece], names: list[str]) -> None:
    """Have the store check everything this rank's reads will touch (each tensor's metadata,
    the source datasets of a sharded HDF5 checkpoint opened with deferred checks) before
    anything is installed: a load without the verify stage."""
    by_name = {p.name: p for p in pieces}
    for name in names:
        parts = plan_reads(by_name[name], stored_boxes(ck, name))
        if parts:
            ck.check_metadata(name)
        for part in parts:
            ck.check_region(name, part)


def verify_shards(ck: Checkpoint, names: list[str], comm: Collective,
                  holders: list[dict[str, Box]] | None = None,
                  pieces: list[Piece] | None = None,
                  ) -> dict[tuple[str, Box], list[tuple[Region, Any]]]:
    """Check every stored shard's digest of ``names``, each shard by one rank (see
    :func:`assign_verifiers`; ``holders``: every rank's box per name, default none), and each
    tensor's metadata by one rank; every rank raises if any rank found a problem. Returns the
    verified blocks this rank installs from memory, by (name, shard box): shards its own box
    holds (up to :data:`KEPT_BYTES`), and small shards another rank checked and sent (each
    checked again here against its recorded digest).

    ``pieces`` (this rank's targets): in the same stage, the store checks everything the
    install will read from it (:func:`check_planned_reads`' check of the other parts)."""
    units, metadata = _verify_units(ck, names)
    with_metadata = set(metadata)
    holders = holders if holders is not None else [{} for _ in range(comm.size)]
    itemsizes = {n: ck.layout[n].format.storage_dtype.itemsize
                 * ck.layout[n].format.words_per_value for n in names}
    recorded = {n: ck.shards(n) for n in names}  # each tensor's list copied once, not per unit
    writers = [None if k is None else recorded[name][k].rank for name, k, _box in units]
    ranks = assign_verifiers(units, itemsizes, holders, writers)
    mine = holders[comm.rank]
    sent = sent_units(units, ranks, itemsizes, holders)
    kept: dict[tuple[str, Box], list[tuple[Region, Any]]] = {}
    room = KEPT_BYTES
    with stage(comm) as st:
        # a tensor whose metadata another rank checks in this stage is not checked again by
        # this rank's reads: nothing read here is installed before the agreement that closes
        # the stage, which carries that rank's verdict (reads follow the description the
        # checkpoint was opened from, not the metadata being compared)
        for i in with_metadata:
            if ranks[i] != comm.rank:
                ck.metadata_checked_elsewhere(units[i][0])
        if pieces is not None:  # what the install will read from the store, checked now
            from_memory = {(name, box) for i, ((name, _k, box), rank) in enumerate(
                zip(units, ranks)) if rank == comm.rank or i in sent}
            _check_other_reads(ck, pieces, names, from_memory)
        outgoing: dict[str, list[list[Any]]] = {}
        for i, ((name, k, box), rank) in enumerate(zip(units, ranks)):
            if rank != comm.rank:
                continue
            if i in with_metadata:  # the tensor's own metadata, for every rank
                ck.check_metadata(name)
            keep = i in sent or (_holds(mine.get(name), box)
                                 and box.size * itemsizes[name] <= room)
            if not keep:
                for _ in ck.blocks(name, shard=k, reuse=True):
                    pass
                continue
            blocks = list(ck.blocks(name, shard=k))  # whole: every chunk and the digest checked
            if i in sent:
                outgoing[str(i)] = [[list(b.offsets), list(b.lengths),
                                     base64.b64encode(np.ascontiguousarray(w).tobytes()).decode()]
                                    for b, w in ((_box_of(r), w) for r, w in blocks)]
            if _holds(mine.get(name), box):
                kept[name, box] = blocks
                room -= box.size * itemsizes[name]
        st.share(outgoing)
    for i, ((name, k, box), rank) in enumerate(zip(units, ranks)):
        if rank == comm.rank:  # checked by another rank: not again here
            continue
        if k is not None:
            ck.checked_elsewhere(name, k)
        if i in sent and k is not None and _holds(mine.get(name), box):
            kept[name, box] = received_blocks(ck, name, recorded[name][k], st.shared[rank][str(i)])
    return kept


SENT_BYTES = 4096
"""Shards at most this large that several ranks install (replicated step counts, biases) are
read by their checking rank only, which sends the words to the others in its agreement..."""
SENT_TOTAL = 1 << 20
"""... up to this many bytes in all (the rest are read by each rank), so what an agreement
carries stays bounded however many ranks and tensors there are."""


def sent_units(units: list[Unit], ranks: list[int], itemsizes: dict[str, int],
               holders: list[dict[str, Box]]) -> set[int]:
    """The units their checking rank sends to the others: recorded shards of at most
    :data:`SENT_BYTES` that another rank holds whole, in order until :data:`SENT_TOTAL` bytes.
    Pure: every rank computes the same set."""
    sent: set[int] = set()
    budget = SENT_TOTAL  # what every rank receives, all senders together
    for i, ((name, k, box), rank) in enumerate(zip(units, ranks)):
        nbytes = box.size * itemsizes[name]
        if k is not None and nbytes <= min(SENT_BYTES, budget) and any(
                _holds(h.get(name), box) for r, h in enumerate(holders) if r != rank):
            sent.add(i)
            budget -= nbytes
    return sent


def _box_of(region: Region) -> Box:
    return Box(tuple(s.start for s in region), tuple(s.stop - s.start for s in region))


def received_blocks(ck: Checkpoint, name: str, shard: Any, items: list[list[Any]]
              ) -> list[tuple[Region, Any]]:
    """The blocks of ``shard`` another rank sent, checked against its recorded digest."""
    fmt = ck.layout[name].format
    pair = (2,) if fmt.words_per_value == 2 else ()
    blocks, crc = [], 0
    for offsets, lengths, text in items:
        # writable (a bytearray): torch.from_numpy warns of a read-only array when installing
        words = np.frombuffer(bytearray(base64.b64decode(text)), dtype=fmt.storage_dtype)
        words = words.reshape(tuple(lengths) + pair)
        crc = crc32c_update(crc, words)
        blocks.append((Box.of(offsets, lengths).region(), words))
    if crc != shard.crc32c:  # a peer's bytes are checked like the store's
        raise IntegrityError(f"tensor {name!r}: shard {shard.box} as received from the rank "
                             f"that checked it has crc32c {crc:#010x}, the recorded digest is "
                             f"{shard.crc32c:#010x}")
    return blocks


def _check_other_reads(ck: Checkpoint, pieces: list[Piece], names: list[str],
                       from_memory: set[tuple[str, Box]]) -> None:
    """:func:`check_planned_reads` (metadata apart) of the parts not installed from memory."""
    by_name = {p.name: p for p in pieces}
    for name in names:
        for part in plan_reads(by_name[name], stored_boxes(ck, name)):
            if (name, part) not in from_memory:
                ck.check_region(name, part)


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
