"""A sharded load, and a blocking sharded save, pause Python's cyclic garbage collector while
they run (issue 13: collections of a training process's heap cost ~15 % of a rank's load and
~20 % of the CPU of a save) and restore it after: on success, on a refused load, and leaving
a collector the caller switched off, off. A background save does not pause it (the pause
would hold the training thread's collector off). A 2-rank
gloo world on loopback runs this file as a script, one process per rank (``python
test_sharded_load_gc.py SCENARIO RANK WORLD PORT DIR``)."""

from __future__ import annotations

import gc
from pathlib import Path

import gloo_world
import pytest

from lean_store.gc_pause import collection_paused

HERE = Path(__file__).resolve()
WORLD_TIMEOUT = 120


def test_the_collector_is_off_inside_and_on_again_after() -> None:
    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
        with collection_paused():  # nested: the outer pause restores it
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_collector_is_restored_when_the_block_raises() -> None:
    with pytest.raises(ValueError), collection_paused():
        raise ValueError("boom")
    assert gc.isenabled()


def test_a_collector_switched_off_by_the_caller_stays_off() -> None:
    gc.disable()
    try:
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def _state(rank: int, fill: float | None = None) -> dict:
    import torch

    from lean_store.distributed import LocalShard

    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    part = full[4 * rank: 4 * (rank + 1)].clone()
    if fill is not None:
        part.fill_(fill)
    return {"w": LocalShard(part, (8, 6), (4 * rank, 0)), "step": torch.tensor(3)}


def scenario_gc(rank: int, world: int, out: Path) -> dict:
    import torch

    import lean_store as ls
    from lean_store.distributed import sharded_load, sharded_save

    seen: list[bool] = []
    saving: list[bool] = []
    real, real_plan = sharded_load.verify_shards, sharded_save.make_plan

    def watching(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    def planning(*args, **kwargs):
        saving.append(gc.isenabled())
        return real_plan(*args, **kwargs)

    sharded_load.verify_shards = watching
    sharded_save.make_plan = planning
    rec: dict = {}
    for suffix in (".h5", ".zarr"):
        path = out / f"ck{suffix}"
        saving.clear()
        ls.save(_state(rank), path)
        rec[suffix + " save"] = {"inside": list(saving), "after": gc.isenabled()}
        saving.clear()
        ls.save(_state(rank), path, blocking=False).wait()  # a background save: no pause,
        rec[suffix + " background"] = list(saving)  # which would hold the caller's off too
        seen.clear()
        target = _state(rank, fill=-1.0)
        ls.load(target, path)
        rec[suffix] = {"inside": list(seen), "after": gc.isenabled(),
                       "good": bool(target["w"].tensor.equal(_state(rank)["w"].tensor))}
    wrong = {"w": _state(rank)["w"], "step": torch.zeros(2)}  # a shape the checkpoint lacks
    try:
        ls.load(wrong, out / "ck.h5")
        rec["refused"] = None
    except ls.CheckpointError as exc:
        rec["refused"] = type(exc).__name__
    rec["after refused"] = gc.isenabled()
    gc.disable()
    ls.load(_state(rank, fill=-1.0), out / "ck.h5")
    rec["caller's off stays off"] = not gc.isenabled()
    gc.enable()
    return rec


SCENARIOS = {"gc": scenario_gc}


@pytest.fixture(scope="module")
def gc_world(tmp_path_factory):
    return gloo_world.torch_world(tmp_path_factory, HERE, "gc", 2, timeout=WORLD_TIMEOUT)


def test_a_sharded_load_runs_with_the_collector_paused_and_restores_it(gc_world) -> None:
    for rec in gc_world:
        for suffix in (".h5", ".zarr"):
            assert rec[suffix + " save"] == {"inside": [False], "after": True}, rec
            assert rec[suffix + " background"] == [True], rec
            got = rec[suffix]
            assert got["good"], (suffix, got)
            assert got["inside"] == [False], (suffix, got)  # paused during the load
            assert got["after"], (suffix, got)  # and on again after it
        assert rec["refused"] is not None and rec["after refused"]
        assert rec["caller's off stays off"]


if __name__ == "__main__":
    gloo_world.main(SCENARIOS, timeout_s=WORLD_TIMEOUT)
