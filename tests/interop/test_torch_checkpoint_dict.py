"""A torch checkpoint dict (``torch.save({"model": ..., "optimizer": ..., "epoch": 3})``, the
most common hand-written training checkpoint) converts to HDF5 or Zarr without pickle: its
tensors as checked datasets by key path, its plain data as JSON (docs/FORMAT.md 7.2), read
back as the same dict with ``load_checkpoint_dict`` or converted back to ``.pt``. Before,
``lean-store convert`` refused it ("not a flat state dict of tensors")."""

from __future__ import annotations

import math

import pytest
from torch_optional import require_torch

torch = require_torch()

import lean_store as ls  # noqa: E402
from lean_store.cli import main  # noqa: E402
from lean_store.interop.checkpoint_dict import load_checkpoint_dict  # noqa: E402
from lean_store.interop.convert import convert  # noqa: E402


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Linear(8, 2))


def _run(steps: int, net: torch.nn.Module, opt: torch.optim.Optimizer, sched, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(6, 4, generator=gen)).square().mean().backward()
        opt.step()
        sched.step()


def _setup(seed: int):
    torch.manual_seed(seed)
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return net, opt, sched


def _checkpoint() -> tuple[dict, tuple]:
    net, opt, sched = _setup(0)
    _run(3, net, opt, sched, seed=1)
    ckpt = {
        "model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
        "epoch": 3, "best_loss": math.inf, "history": [0.5, float("nan"), 0.25],
        "step_big": 2**62, "args": {"lr": 0.01, "betas": (0.9, 0.999), "name": "run-1"},
        "rng": torch.get_rng_state(), "half": torch.arange(4, dtype=torch.bfloat16),
    }
    return ckpt, (net, opt, sched)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and bool(torch.equal(a.reshape(-1).view(torch.uint8),
                                     b.reshape(-1).view(torch.uint8))))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_training_checkpoint_dict_converts_and_resumes_exactly(tmp_path, suffix) -> None:
    ckpt, (net, opt, sched) = _checkpoint()
    torch.save(ckpt, tmp_path / "ckpt.pt")
    out = tmp_path / f"ckpt{suffix}"
    layout = convert(tmp_path / "ckpt.pt", out)
    assert "model/0.weight" in layout and "optimizer/state/0/exp_avg" in layout
    assert ls.verify(out).ok
    got = load_checkpoint_dict(out)
    assert _same(ckpt, got)
    # resumed from the converted file, the run goes on exactly as the original
    net2, opt2, sched2 = _setup(7)
    net2.load_state_dict(got["model"])
    opt2.load_state_dict(got["optimizer"])
    sched2.load_state_dict(got["scheduler"])
    _run(2, net, opt, sched, seed=2)
    _run(2, net2, opt2, sched2, seed=2)
    assert _same(net.state_dict(), net2.state_dict())


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_the_checkpoint_dict_converts_back_to_torch_exactly(tmp_path, suffix, capsys) -> None:
    ckpt, _ = _checkpoint()
    torch.save(ckpt, tmp_path / "ckpt.pt")
    assert main(["convert", str(tmp_path / "ckpt.pt"), str(tmp_path / f"c{suffix}")]) == 0
    assert main(["convert", str(tmp_path / f"c{suffix}"), str(tmp_path / "back.pt")]) == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert _same(ckpt, back)
    assert main(["diff", str(tmp_path / "ckpt.pt"), str(tmp_path / f"c{suffix}")]) == 0
    capsys.readouterr()
    # safetensors holds tensors only: refused, nothing written
    assert main(["convert", str(tmp_path / f"c{suffix}"), str(tmp_path / "x.safetensors")]) == 2
    assert "checkpoint dict" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()


def test_what_cannot_be_stored_is_refused_by_key_before_anything_is_written(tmp_path) -> None:
    torch.save({"model": {"w": torch.ones(2)}, "tags": {1, 2}}, tmp_path / "set.pt")
    with pytest.raises(ls.FormatError, match="tags"):
        convert(tmp_path / "set.pt", tmp_path / "set.h5")
    assert not (tmp_path / "set.h5").exists()


def test_a_flat_state_dict_still_converts_as_a_state(tmp_path) -> None:
    torch.save(_net().state_dict(), tmp_path / "sd.pt")
    convert(tmp_path / "sd.pt", tmp_path / "sd.h5")
    with ls.open(tmp_path / "sd.h5") as ck:
        assert "lightning" not in ck.root_attrs and "0.weight" in ck.layout
    with pytest.raises(ls.CheckpointError, match="not a Lightning one"):
        load_checkpoint_dict(tmp_path / "sd.h5")
