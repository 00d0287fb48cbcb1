"""A mixed-precision loss scaler (``torch.amp.GradScaler``) is part of a training checkpoint
(``scaler=``): without its scale and growth tracker a resumed fp16 run starts again from the
initial scale, skipping steps (inf gradients) the uninterrupted run took, so it is not an exact
resume. Validated like a scheduler (its class, its keys) before anything is changed."""

from __future__ import annotations

import pytest
from torch_optional import require_torch

torch = require_torch()

import lean_store as ls  # noqa: E402

BACKENDS = [".h5", ".zarr"]
STEPS_BEFORE, STEPS_AFTER = 7, 6


def _setup(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=2)
    return model, opt, scaler


def _steps(model, opt, scaler, first: int, count: int) -> None:
    for i in range(first, first + count):
        x = torch.linspace(-1, 1, 10).reshape(2, 5) * (i + 1)
        loss = model(x).pow(2).sum()
        if i % 5 == 2:  # an overflow: the scaler skips this step and backs off
            loss = loss * float("inf")
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def _bits(model) -> list[bytes]:
    return [p.detach().numpy().tobytes() for p in model.parameters()]


@pytest.mark.parametrize("suffix", BACKENDS)
def test_a_resumed_run_with_the_scaler_is_exact(tmp_path, suffix) -> None:
    model, opt, scaler = _setup(0)
    _steps(model, opt, scaler, 0, STEPS_BEFORE)
    path = tmp_path / f"t{suffix}"
    ls.save_training(path, model=model, optimizer=opt, scaler=scaler, step=STEPS_BEFORE)
    _steps(model, opt, scaler, STEPS_BEFORE, STEPS_AFTER)  # the uninterrupted run

    fresh, fresh_opt, fresh_scaler = _setup(1)
    ls.load_training(path, model=fresh, optimizer=fresh_opt, scaler=fresh_scaler)
    _steps(fresh, fresh_opt, fresh_scaler, STEPS_BEFORE, STEPS_AFTER)
    assert fresh_scaler.state_dict() == scaler.state_dict()
    assert _bits(fresh) == _bits(model)

    # without the scaler's state the run goes on from the initial scale: not the same run
    other, other_opt, other_scaler = _setup(1)
    ls.load_training(path, model=other, optimizer=other_opt)
    _steps(other, other_opt, other_scaler, STEPS_BEFORE, STEPS_AFTER)
    assert other_scaler.state_dict() != scaler.state_dict()


@pytest.mark.parametrize("suffix", BACKENDS)
def test_checkpointer_keeps_the_scaler(tmp_path, suffix) -> None:
    model, opt, scaler = _setup(0)
    _steps(model, opt, scaler, 0, STEPS_BEFORE)
    run = ls.Checkpointer(tmp_path / "run", backend="hdf5" if suffix == ".h5" else "zarr")
    run.save(STEPS_BEFORE, model=model, optimizer=opt, scaler=scaler)
    fresh, fresh_opt, fresh_scaler = _setup(1)
    run.restore(model=fresh, optimizer=fresh_opt, scaler=fresh_scaler)
    assert fresh_scaler.state_dict() == scaler.state_dict()


def test_scaler_mismatches_are_refused_before_anything_changes(tmp_path) -> None:
    model, opt, scaler = _setup(0)
    _steps(model, opt, scaler, 0, 3)
    path = tmp_path / "t.h5"
    ls.save_training(path, model=model, optimizer=opt, step=3)
    fresh, fresh_opt, fresh_scaler = _setup(1)
    before = _bits(fresh)
    with pytest.raises(ls.CheckpointError, match="holds no scaler state"):
        ls.load_training(path, model=fresh, optimizer=fresh_opt, scaler=fresh_scaler)
    assert _bits(fresh) == before

    ls.save_training(tmp_path / "off.h5", model=model,
                     scaler=torch.amp.GradScaler("cpu", enabled=False))  # saves {} as its state
    with pytest.raises(ls.LayoutError, match="scaler keys"):
        ls.load_training(tmp_path / "off.h5", model=fresh, scaler=fresh_scaler)
    assert _bits(fresh) == before

    with pytest.raises(ls.CheckpointError, match="scaler must have state_dict"):
        ls.save_training(tmp_path / "x.h5", model=model, scaler=2.0 ** 16)
    assert not (tmp_path / "x.h5").exists()
