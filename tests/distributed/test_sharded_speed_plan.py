"""The pure planning behind faster sharded saves and loads (issue 13): replicas spread over
their holders at save, each stored shard checked by the rank that installs it (its writer where
possible) at load, and what a rank receives from another checked against the recorded digest."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from lean_store.distributed.plan import METADATA_COST, make_plan
from lean_store.distributed.shard_spec import Box
from lean_store.distributed.sharded_load import (
    SENT_BYTES,
    SENT_TOTAL,
    assign_verifiers,
    received_blocks,
    sent_units,
)
from lean_store.errors import IntegrityError
from lean_store.integrity import crc32c_of
from lean_store.layout import Layout


def _description(layout: Layout, boxes: list[Box]) -> dict:
    return {"layout": layout.to_json(),
            "boxes": [[list(b.offsets), list(b.lengths)] for b in boxes], "strided": {}}


def test_replicas_are_written_by_the_least_loaded_holders_not_all_by_rank_zero() -> None:
    from lean_store.formats import get

    f32 = get("float32")
    names = ["w", "a", "b", "c", "d"]
    layout = Layout.from_specs([("w", (8,), f32)] + [(n, (), f32) for n in names[1:]])
    whole = Box((0,), (1,))
    descriptions = [_description(layout, [Box((4 * r,), (4,))] + [whole] * 4)
                    for r in range(2)]
    _layout, plans = make_plan(descriptions)
    assert [owner for _box, owner in plans[0].shards] == [0, 1]  # shards: their sole holder
    # rank 0 also writes the five tensors' metadata (5 x METADATA_COST): the four replicas
    # (METADATA_COST + 4 bytes each) all fit under that on rank 1
    assert [plans[i].shards[0][1] for i in range(1, 5)] == [1, 1, 1, 1]
    wide = Layout.from_specs([("w", (12,), f32)] + [(n, (), f32) for n in names[1:]])
    big = [_description(wide, [Box((4 * r,), (4,))] + [whole] * 4) for r in range(3)]
    spread = [p.shards[0][1] for p in make_plan(big)[1][1:]]
    assert spread == [1, 2, 1, 2]  # least loaded first, lowest rank on ties
    again = make_plan(descriptions)[1]
    assert [p.shards for p in again] == [p.shards for p in plans]  # the same on every rank
    assert METADATA_COST > 0


def test_a_shard_is_checked_by_its_writer_when_that_rank_installs_it() -> None:
    units = [("w", 0, Box((0,), (4,))), ("w", 1, Box((4,), (4,))), ("s", 0, Box((0,), (1,)))]
    holders = [{"w": Box((0,), (4,)), "s": Box((0,), (1,))},
               {"w": Box((4,), (4,)), "s": Box((0,), (1,))}]
    sizes = {"w": 4, "s": 8}
    assert assign_verifiers(units, sizes, holders, [0, 1, 1]) == [0, 1, 1]
    # a writer that does not hold it whole (another world size): the least loaded holder
    assert assign_verifiers(units, sizes, holders, [3, 3, 3]) == [0, 1, 0]
    # nobody holds a unit whole (resharded): the least loaded rank of all
    strips = [{"w": Box((0,), (2,))}, {"w": Box((2,), (6,))}]
    assert assign_verifiers(units[:2], sizes, strips) == [0, 1]


def test_words_received_from_another_rank_are_checked_against_the_digest() -> None:
    from lean_store.formats import get
    from lean_store.layout import Layout

    class _Ck:
        layout = Layout.from_specs([("s", (), get("int64"))])

    class _Shard:
        box = Box((0,), (1,))
        words = np.array([7], np.int64)
        crc32c = crc32c_of(words)

    item = [[0], [1], base64.b64encode(_Shard.words.tobytes()).decode()]
    ((region, words),) = received_blocks(_Ck(), "s", _Shard(), [item])
    assert region == (slice(0, 1),) and words.tolist() == [7]
    assert words.flags.writeable  # installing it through torch.from_numpy warns otherwise
    forged = [[0], [1], base64.b64encode(np.array([8], np.int64).tobytes()).decode()]
    with pytest.raises(IntegrityError, match="recorded digest"):
        received_blocks(_Ck(), "s", _Shard(), [forged])


def test_small_shards_other_ranks_hold_are_sent_within_a_total_bound() -> None:
    one = Box((0,), (1,))
    everyone = [{"s": one, "w": Box((0,), (4,))}, {"s": one, "w": Box((4,), (4,))}]
    units = [("s", 0, one), ("w", 0, Box((0,), (4,))), ("s", None, one)]
    # a replicated step count: sent; a shard only its checker holds, or a tensor saved whole
    # (no recorded shard digest to check it against): not
    assert sent_units(units, [0, 0, 1], {"s": 8, "w": 4}, everyone) == {0}
    assert sent_units(units[:1], [0], {"s": SENT_BYTES + 1, "w": 4}, everyone) == set()
    many = [("s", 0, one)] * (SENT_TOTAL // SENT_BYTES + 3)
    sent = sent_units(many, [0] * len(many), {"s": SENT_BYTES}, everyone)
    assert sent == set(range(SENT_TOTAL // SENT_BYTES))  # then the rest are read by each
