"""Convert, then load: a safetensors file (tensors sorted by dtype and name) converted to
lean_store loads into the model it came from by name; order is checked only when asked for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from torch_optional import require_torch

import lean_store as ls
from lean_store.cli import main as cli_main

torch = require_torch()
from safetensors.torch import save_file  # noqa: E402 (needs torch)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Module order differs from name order: "10.weight" sorts before "2.weight".
    layers = [torch.nn.Linear(4, 4) for _ in range(11)]
    net = torch.nn.Sequential(*layers, torch.nn.BatchNorm1d(4))
    net(torch.randn(3, 4))  # updates the BatchNorm buffers
    return net


def fresh() -> torch.nn.Module:
    net = model()
    with torch.no_grad():
        for t in net.state_dict().values():
            t.zero_()
    return net


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        bits_a, bits_b = (t.reshape(-1).view(torch.uint8) for t in (a[name], b[name]))
        assert torch.equal(bits_a, bits_b), name


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_convert_then_load_matches_by_name(tmp_path: Path, suffix: str) -> None:
    src, dst = tmp_path / "model.safetensors", tmp_path / f"model{suffix}"
    want = model().state_dict()
    save_file(want, src)
    assert cli_main(["convert", str(src), str(dst)]) == 0
    with ls.open(dst) as ck:
        assert sorted(ck.layout.names()) == sorted(want)
        assert ck.layout.names() != list(want)  # safetensors' order, not the module's

    target = fresh()
    result = ls.load(target, dst)
    assert sorted(result.loaded) == sorted(want)
    same_bits(target.state_dict(), want)

    state = ls.load_state(dst, like=model())
    assert list(state) == list(want)  # in like's order
    same_bits(state, want)


def test_numpy_dict_target_matches_by_name(tmp_path: Path) -> None:
    src, dst = tmp_path / "model.safetensors", tmp_path / "model.zarr"
    want = {k: v.numpy() for k, v in model().state_dict().items()}
    save_file(model().state_dict(), src)
    cli_main(["convert", str(src), str(dst)])
    target = {k: np.zeros_like(v) for k, v in want.items()}
    ls.load(target, dst)
    for name, value in want.items():
        assert target[name].tobytes() == value.tobytes(), name


def test_strict_order_still_refuses_another_order(tmp_path: Path) -> None:
    src, dst = tmp_path / "model.safetensors", tmp_path / "model.h5"
    save_file(model().state_dict(), src)
    cli_main(["convert", str(src), str(dst)])
    target = fresh()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ls.LayoutError) as err:
        ls.load(target, dst, strict_order=True)
    assert {d.kind for d in err.value.differences} == {"order"}
    same_bits(target.state_dict(), before)  # unchanged on error
    with pytest.raises(ls.LayoutError):
        ls.load_state(dst, like=model(), strict_order=True)


def test_other_differences_are_still_reported_together(tmp_path: Path) -> None:
    """Name matching drops only the order check: missing, unexpected, shape and format
    differences all come in one error."""
    state = {k: v.clone() for k, v in model().state_dict().items()}
    state["extra.bias"] = torch.zeros(2)
    del state["0.weight"]
    state["1.weight"] = torch.zeros(4, 5)
    state["2.weight"] = state["2.weight"].to(torch.float64)
    path = tmp_path / "model.safetensors"
    save_file(state, path)
    cli_main(["convert", str(path), str(tmp_path / "m.h5")])
    with pytest.raises(ls.LayoutError) as err:
        ls.load(fresh(), tmp_path / "m.h5")
    kinds = sorted((d.kind, d.name) for d in err.value.differences)
    assert kinds == [
        ("extra", "extra.bias"), ("format", "2.weight"), ("missing", "0.weight"),
        ("shape", "1.weight"),
    ]
