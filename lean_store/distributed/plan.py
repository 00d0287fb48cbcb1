"""The global save plan, computed identically on every rank from everyone's local description:
the layout all ranks must agree on, and for each tensor its distinct shards and their owners."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, LayoutError
from ..layout import Entry, Layout
from .dtensor_blocks import strided_refusal
from .local_state import Piece, layout_of
from .shard_spec import Box, assign_owners, coverage_problems


@dataclass(frozen=True)
class TensorPlan:
    """One tensor: ``shards[k] = (box, owner rank)`` sorted by offsets."""

    entry: Entry
    shards: tuple[tuple[Box, int], ...]

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return self.entry.shape or (1,)

    def owned(self, rank: int) -> list[tuple[int, Box]]:
        return [(k, box) for k, (box, owner) in enumerate(self.shards) if owner == rank]


def describe(pieces: list[Piece]) -> dict[str, Any]:
    """This rank's contribution to the plan (plain JSON)."""
    return {
        "layout": layout_of(pieces).to_json(),
        "boxes": [[list(p.box.offsets), list(p.box.lengths)] for p in pieces],
        "strided": {str(i): p.strided for i, p in enumerate(pieces) if p.strided},
    }


def make_plan(descriptions: list[dict[str, Any]]) -> tuple[Layout, list[TensorPlan]]:
    """Check that every rank has the same layout and that each tensor's distinct shards cover
    it exactly once; returns the layout and one plan per tensor."""
    layout = Layout.from_json(descriptions[0]["layout"])
    for rank, d in enumerate(descriptions[1:], start=1):
        if d["layout"] == descriptions[0]["layout"]:  # the same JSON: the same layout
            continue
        diffs = Layout.from_json(d["layout"]).diff(layout)
        if diffs:
            lines = "\n".join(f"  - {d}" for d in diffs)
            raise LayoutError(f"rank {rank} holds a different state than rank 0:\n{lines}", diffs)
    plans = []
    held_all: list[list[Box]] = []  # held_all[i][r]: rank r's box of tensor i
    for i, entry in enumerate(layout):
        held_all.append([Box.of(*d["boxes"][i]) for d in descriptions])
        held = [[box] for box in held_all[-1]]
        what = f"tensor {entry.name!r}"
        strided = [d.get("strided", {}).get(str(i)) for d in descriptions]
        placements = next((s for s in strided if s), None)
        if placements is not None:
            distinct = sorted({b for boxes in held for b in boxes if not b.empty})
            problems = coverage_problems(entry.shape or (1,), distinct, what)
            if problems:
                raise strided_refusal(entry.name, placements, problems)
        shards = assign_owners(entry.shape or (1,), held, what)
        plans.append(TensorPlan(entry, tuple(shards)))
    return layout, balance_replicas(plans, held_all)


METADATA_COST = 64 << 10
"""What writing one tensor's metadata costs rank 0 (a master dataset, a ``zarr.json``), and
writing one shard any rank (a dataset, a chunk file), in bytes of data written, for
:func:`balance_replicas`."""


def balance_replicas(plans: list[TensorPlan], held: list[list[Box]]) -> list[TensorPlan]:
    """Replicas (a box several ranks hold: a bias, a step count) are written by the least loaded
    of their holders (lowest rank on ties), counting the bytes every rank writes anyway and
    rank 0's metadata, instead of all by the lowest rank. ``held[i][r]`` is rank r's box of
    tensor i (parsed once by :func:`make_plan`). Pure: every rank computes the same."""
    world = len(held[0]) if held else 1
    load = [0] * world
    load[0] = METADATA_COST * len(plans)
    holders: list[list[list[int]]] = []
    for plan, boxes in zip(plans, held):
        nbytes = plan.entry.format.storage_dtype.itemsize * plan.entry.format.words_per_value
        by_box: dict[Box, list[int]] = {}  # one pass over the ranks, not one per shard
        for r, b in enumerate(boxes):
            by_box.setdefault(b, []).append(r)
        holders.append([by_box.get(box, []) for box, _ in plan.shards])
        for (box, owner), ranks in zip(plan.shards, holders[-1]):
            if len(ranks) == 1:
                load[owner] += box.size * nbytes + METADATA_COST
    out = []
    for plan, held_by in zip(plans, holders):
        nbytes = plan.entry.format.storage_dtype.itemsize * plan.entry.format.words_per_value
        shards = []
        for (box, owner), ranks in zip(plan.shards, held_by):
            if len(ranks) > 1:
                owner = min(ranks, key=lambda r: (load[r], r))
                load[owner] += box.size * nbytes + METADATA_COST
            shards.append((box, owner))
        out.append(TensorPlan(plan.entry, tuple(shards)))
    return out


def shard_records(plan: TensorPlan, digests: dict[int, list[Any]]) -> str:
    """The ``shards`` attribute: JSON list of {offsets, lengths, rank, crc32c, unit}."""
    records = []
    for k, (box, owner) in enumerate(plan.shards):
        crc, unit = digests[k]
        records.append({**box.to_json(), "rank": owner, "crc32c": int(crc), "unit": list(unit)})
    return json.dumps(records, separators=(",", ":"))


def collect_digests(
    plans: list[TensorPlan], per_rank: list[dict[str, Any]]
) -> list[dict[int, list[Any]]]:
    """Merge each rank's ``{"tensor index/k": [crc, unit]}`` into per-tensor maps, checking
    that every shard was written by its owner."""
    merged: list[dict[int, list[Any]]] = [{} for _ in plans]
    for report in per_rank:
        for key, value in (report or {}).items():
            i, k = (int(x) for x in key.split("/"))
            merged[i][k] = value
    for i, plan in enumerate(plans):
        missing = [k for k in range(len(plan.shards)) if k not in merged[i]]
        if missing:
            raise CheckpointError(f"tensor {plan.entry.name!r}: shards {missing} were not written")
    return merged
