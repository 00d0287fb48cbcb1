"""``Collective.all_gather_json`` on real gloo ranks: payloads that fit the inline buffer take one
all-gather (issue 13: fewer collective rounds per sharded save and load), a longer payload on
any rank a second one, and every rank gets every rank's value, in rank order, either way."""

from __future__ import annotations

import sys
from pathlib import Path

from torch_optional import require_torch  # noqa: E402

require_torch()
from test_distributed import run_world  # noqa: E402

HERE = Path(__file__).resolve()


def _payload(rank: int, case: str):
    from lean_store.distributed.collective import INLINE_BYTES

    if case == "small":
        return {"rank": rank, "text": "é" * rank}
    if case == "one long":  # only rank 1 overflows the inline buffer
        return "x" * (INLINE_BYTES + 10) if rank == 1 else [rank]
    if case == "exactly inline":  # JSON of exactly INLINE_BYTES (the quotes included)
        return "y" * (INLINE_BYTES - 2)
    return None


CASES = ("small", "one long", "exactly inline", "none")


def scenario_gather(rank: int, world: int, out: Path) -> dict:
    import torch.distributed as dist

    from lean_store.distributed.collective import Collective

    comm = Collective()
    calls = []
    real = dist.all_gather

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_gather = counting
    rec = {}
    for case in CASES:
        calls.clear()
        got = comm.all_gather_json(_payload(rank, case))
        rec[case] = {"ok": got == [_payload(r, case) for r in range(world)],
                     "rounds": len(calls)}
    return rec


SCENARIOS = {"gather": scenario_gather}


def test_all_gather_json_gives_every_rank_every_value_in_one_round_when_it_fits(tmp_path):
    recs = run_world("gather", 3, tmp_path, script=HERE)
    for rec in recs:
        assert all(rec[case]["ok"] for case in CASES), rec
        assert rec["small"]["rounds"] == rec["none"]["rounds"] == 1
        assert rec["exactly inline"]["rounds"] == 1
        assert rec["one long"]["rounds"] == 2


if __name__ == "__main__":
    from test_distributed import worker

    _scenario, _rank, _world, _port, _out = sys.argv[1:6]
    worker(_scenario, int(_rank), int(_world), int(_port), Path(_out), SCENARIOS)
