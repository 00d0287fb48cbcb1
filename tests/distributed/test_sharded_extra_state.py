"""A sharded load hands a module's extra state to its ``set_extra_state`` (FSDP2 models with
TransformerEngine-style FP8 state): the stored tensor, whatever shape the fresh module's extra
state has, as a single-process load does (tests/core/test_module_extra_state.py), whether the
target is the module or ``lean_store.distributed.training_state(model, optimizer)``. A 2-rank
gloo world on loopback runs this file as a script, one process per rank (``python
test_sharded_extra_state.py SCENARIO RANK WORLD PORT DIR``)."""

from __future__ import annotations

import pickle
from pathlib import Path

import gloo_world
import pytest

HERE = Path(__file__).resolve()
WORLD_TIMEOUT = 120


def _model(seed: int, history: list[float] | None) -> tuple:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.history: list[float] | None = None

        def get_extra_state(self) -> torch.Tensor:
            return torch.frombuffer(bytearray(pickle.dumps(self.history)), dtype=torch.uint8)

        def set_extra_state(self, state: torch.Tensor) -> None:
            self.history = pickle.loads(state.numpy().tobytes())

    torch.manual_seed(seed)
    model = torch.nn.Sequential(Scaled(), torch.nn.ReLU(), Scaled())
    model[2].history = history
    fully_shard(model, mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def scenario_extra(rank: int, world: int, out: Path) -> dict:
    import lean_store as ls
    from lean_store.distributed import init_optimizer_state, training_state

    history = [float(i) for i in range(30)]
    saved, opt = _model(0, history)
    init_optimizer_state(opt)
    full = {n: p.full_tensor() for n, p in saved.named_parameters()}
    rec: dict = {}
    for suffix in (".h5", ".zarr"):
        path = out / f"ck{suffix}"
        ls.save(training_state(saved, opt), path)
        fresh, fresh_opt = _model(1, None)
        init_optimizer_state(fresh_opt)
        ls.load(training_state(fresh, fresh_opt), path)
        rec[f"state{suffix}"] = {
            "history": fresh[2].history,
            "weights": all(p.full_tensor().equal(full[n]) for n, p in fresh.named_parameters())}
        module_path = out / f"module{suffix}"
        ls.save(saved, module_path)
        fresh, _ = _model(2, None)
        ls.load(fresh, module_path)
        rec[f"module{suffix}"] = {
            "history": fresh[2].history,
            "weights": all(p.full_tensor().equal(full[n]) for n, p in fresh.named_parameters())}
    rec["expected"] = history
    return rec


SCENARIOS = {"extra": scenario_extra}


@pytest.fixture(scope="module")
def extra_world(tmp_path_factory):
    return gloo_world.torch_world(tmp_path_factory, HERE, "extra", 2, timeout=WORLD_TIMEOUT)


def test_sharded_loads_hand_extra_state_to_the_module(extra_world) -> None:
    for rec in extra_world:
        assert rec is not None
        for key in ("state.h5", "state.zarr", "module.h5", "module.zarr"):
            assert rec[key]["weights"], (key, rec[key])
            assert rec[key]["history"] == rec["expected"], (key, rec[key])


if __name__ == "__main__":
    gloo_world.main(SCENARIOS, timeout_s=WORLD_TIMEOUT)
