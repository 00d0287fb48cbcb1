"""``stage()``: the one try/record/agree helper of the sharded paths, on a fake two-rank group
(this process is rank 0; rank 1's report is given), so every outcome is deterministic."""

from __future__ import annotations

import json
from typing import Any

import pytest

from lean_store import IntegrityError
from lean_store.distributed.collective import Collective, ShardedError, on_rank0, stage

OK = {"ok": True, "payload": "peer"}


class TwoRanks(Collective):
    """Rank 0 of two; the all-gather returns this rank's report and the given peer report."""

    def __init__(self, peer: dict[str, Any] | None = None, broken: bool = False) -> None:
        self.rank, self.size, self.group = 0, 2, None
        self.peer = peer or OK
        self.broken = broken

    def all_gather_json(self, value: Any) -> list[Any]:
        if self.broken:
            raise RuntimeError("Connection reset by peer")
        return [json.loads(json.dumps(value)), self.peer]


def test_a_stage_shares_every_ranks_payload() -> None:
    with stage(TwoRanks()) as st:
        st.share({"boxes": [1, 2]})
    assert st.shared == [{"boxes": [1, 2]}, "peer"]


def test_an_error_here_is_raised_as_the_agreed_error() -> None:
    with pytest.raises(IntegrityError, match=r"^rank 0 of 2: bad chunk$") as info:
        with stage(TwoRanks()):
            raise IntegrityError("bad chunk")
    assert isinstance(info.value.__cause__, IntegrityError)


def test_a_peers_error_is_raised_here_too() -> None:
    peer = {"ok": False, "payload": None, "type": "IntegrityError", "message": "torn shard"}
    reached = []
    with pytest.raises(IntegrityError, match="rank 1 of 2: torn shard"):
        with stage(TwoRanks(peer)):
            reached.append(True)  # this rank's step succeeded
    assert reached == [True]


def test_an_unknown_error_type_becomes_sharded_error() -> None:
    peer = {"ok": False, "payload": None, "type": "OSError", "message": "OSError: disk full"}
    with pytest.raises(ShardedError, match="rank 1 of 2: OSError: disk full"):
        with stage(TwoRanks(peer)):
            pass


def test_a_broken_group_is_a_sharded_error() -> None:
    with pytest.raises(ShardedError, match="process group failed.*nothing was committed"):
        with stage(TwoRanks(broken=True)):
            pass


def test_base_exceptions_are_not_agreed_on() -> None:
    comm = TwoRanks(broken=True)  # agreeing would raise ShardedError instead
    with pytest.raises(KeyboardInterrupt):
        with stage(comm):
            raise KeyboardInterrupt


def test_on_rank0_returns_rank_0s_result() -> None:
    assert on_rank0(TwoRanks(), lambda: ["step_1.h5"]) == ["step_1.h5"]
