"""Models built on the meta device (``with torch.device("meta")``, accelerate's
``init_empty_weights``): the usual way to load a model too big to initialise twice. torch
loads one with ``load_state_dict(state, assign=True)``. Before, ``ls.load`` and
``ls.load_state(like=...)`` refused any meta tensor ("materialize the model first"), so such a
model had to be initialised in full and then overwritten. Now ``ls.load`` gives each meta
parameter and buffer CPU memory in place (the same objects: tied weights, an optimizer and
attributes set on them stay), only once the whole checkpoint is validated and checked, all
or none; ``load_state(like=meta_model)`` returns CPU tensors; ``load_training`` restores an
optimizer built over the meta parameters."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import damage_stored_bytes
from torch_optional import require_torch

torch = require_torch()

import lean_store as ls  # noqa: E402

BACKENDS = [".h5", ".zarr"]


class Net(torch.nn.Module):
    def __init__(self, tied: bool = False, hidden: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.a = torch.nn.Linear(4, hidden)
        self.bn = torch.nn.BatchNorm1d(hidden)
        self.head = torch.nn.Linear(hidden, 4, bias=False)
        self.out = torch.nn.Linear(4, 10, bias=False)
        if tied:
            self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.head(self.bn(self.a(self.embed(ids)))))


def _saved(tmp_path: Path, suffix: str, tied: bool = False) -> tuple[Net, Path]:
    torch.manual_seed(0)
    net = Net(tied)
    with torch.no_grad():
        net.bn.running_mean.add_(1.5)
        net.bn.num_batches_tracked.fill_(7)
    path = tmp_path / f"net{suffix}"
    ls.save(net, path)
    return net, path


def _on_meta(tied: bool = False, hidden: int = 8) -> Net:
    with torch.device("meta"):
        return Net(tied, hidden)


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(
        sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


def _all_meta(net: torch.nn.Module) -> bool:
    return all(t.is_meta for t in (*net.parameters(), *net.buffers()))


@pytest.mark.parametrize("suffix", BACKENDS)
def test_load_gives_meta_tensors_memory_in_place(tmp_path: Path, suffix: str) -> None:
    net, path = _saved(tmp_path, suffix)
    meta = _on_meta()
    weight = meta.a.weight
    weight.no_decay = True  # attributes users set on parameters stay
    optimizer = torch.optim.SGD(meta.parameters(), lr=0.1)
    result = ls.load(meta, path)
    assert len(result.loaded) == len(net.state_dict())
    assert not any(t.is_meta for t in (*meta.parameters(), *meta.buffers()))
    assert {t.device.type for t in meta.state_dict().values()} == {"cpu"}
    assert _same_state(net, meta)
    assert meta.a.weight is weight and weight.no_decay is True
    assert type(weight) is torch.nn.Parameter and weight.requires_grad
    assert not meta.bn.running_mean.requires_grad
    assert optimizer.param_groups[0]["params"][1] is weight
    ids = torch.tensor([1, 4, 7, 9])
    net.eval()
    meta.eval()
    assert torch.equal(meta(ids), net(ids))


@pytest.mark.parametrize("suffix", BACKENDS)
def test_tied_meta_weights_stay_tied(tmp_path: Path, suffix: str) -> None:
    net, path = _saved(tmp_path, suffix, tied=True)
    meta = _on_meta(tied=True)
    ls.load(meta, path)
    assert meta.out.weight is meta.embed.weight
    assert _same_state(net, meta)
    # a file holding one of the twins (Hugging Face's save_pretrained drops the other)
    one = tmp_path / f"one{suffix}"
    ls.save({k: v for k, v in net.state_dict().items() if k != "out.weight"}, one)
    meta = _on_meta(tied=True)
    ls.load(meta, one)
    assert meta.out.weight is meta.embed.weight
    assert torch.equal(meta.out.weight, net.embed.weight)


@pytest.mark.parametrize("suffix", BACKENDS)
def test_a_refused_load_leaves_every_tensor_on_meta(tmp_path: Path, suffix: str) -> None:
    net, path = _saved(tmp_path, suffix)
    wrong = _on_meta(hidden=9)
    with pytest.raises(ls.LayoutError, match="a.weight"):
        ls.load(wrong, path)
    assert _all_meta(wrong)
    # one tensor cannot be swapped (a view of it is held): none is given memory
    held = _on_meta()
    view = held.out.weight[0]
    with pytest.raises(ls.UnsupportedValueError, match="out.weight"):
        ls.load(held, path)
    assert _all_meta(held) and view.is_meta
    # a damaged chunk is found before any tensor gets memory
    damage_stored_bytes(path, net.a.weight.detach().numpy().tobytes()[:16], 3, 0x10)
    damaged = _on_meta()
    with pytest.raises(ls.IntegrityError):
        ls.load(damaged, path)
    assert _all_meta(damaged)


@pytest.mark.parametrize("suffix", BACKENDS)
def test_partly_meta_model(tmp_path: Path, suffix: str) -> None:
    net, path = _saved(tmp_path, suffix)
    part = Net()
    with torch.device("meta"):
        part.head = torch.nn.Linear(8, 4, bias=False)
    memory = part.a.weight.data_ptr()
    ls.load(part, path)
    assert part.a.weight.data_ptr() == memory  # real tensors are written in place
    assert _same_state(net, part)


@pytest.mark.parametrize("suffix", BACKENDS)
def test_strict_false_leaves_missing_meta_tensors(tmp_path: Path, suffix: str) -> None:
    net, _ = _saved(tmp_path, suffix)
    path = tmp_path / f"part{suffix}"
    ls.save({k: v for k, v in net.state_dict().items() if k != "head.weight"}, path)
    meta = _on_meta()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = ls.load(meta, path, strict=False)
    assert result.missing == ["head.weight"] and any("head.weight" in str(w.message)
                                                     for w in caught)
    assert meta.head.weight.is_meta and not meta.a.weight.is_meta
    assert torch.equal(meta.a.weight, net.a.weight)


@pytest.mark.parametrize("suffix", BACKENDS)
def test_load_state_like_a_meta_model(tmp_path: Path, suffix: str) -> None:
    net, path = _saved(tmp_path, suffix)
    template = _on_meta()
    state = ls.load_state(path, like=template)
    assert {t.device.type for t in state.values()} == {"cpu"}
    template.load_state_dict(state, assign=True)
    assert _same_state(net, template)
    with pytest.raises(ls.LayoutError, match="a.weight"):
        ls.load_state(path, like=_on_meta(hidden=9))


@pytest.mark.parametrize("suffix", BACKENDS)
def test_training_resumes_into_a_meta_model(tmp_path: Path, suffix: str) -> None:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    ids = torch.tensor([0, 3, 5, 8, 9, 2])

    def step(model: Net, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad()
        model(ids).square().mean().backward()
        optimizer.step()

    for _ in range(3):
        step(net, opt)
    path = tmp_path / f"train{suffix}"
    ls.save_training(path, model=net, optimizer=opt, step=3)
    meta = _on_meta()
    meta_opt = torch.optim.AdamW(meta.parameters(), lr=0.01)
    ls.load_training(path, model=meta, optimizer=meta_opt)
    assert _same_state(net, meta)
    for _ in range(2):
        step(net, opt)
        step(meta, meta_opt)
    assert _same_state(net, meta)


def test_meta_tensors_cannot_be_saved_or_loaded_into_a_dict(tmp_path: Path) -> None:
    with pytest.raises(ls.UnsupportedValueError, match="meta tensor.*lean_store.load"):
        ls.save(_on_meta(), tmp_path / "x.h5")
    path = tmp_path / "w.h5"
    ls.save({"w": np.zeros(3, np.float32)}, path)
    target = {"w": torch.empty(3, device="meta")}
    with pytest.raises(ls.UnsupportedValueError, match="meta tensor"):
        ls.load(target, path)
    assert target["w"].is_meta


SHARDED_CHILD = """
import sys, torch, torch.distributed as dist
import lean_store as ls
dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1])
path = sys.argv[2]
ls.save(torch.nn.Linear(3, 2), path, process_group=dist.group.WORLD)
with torch.device("meta"):
    meta = torch.nn.Linear(3, 2)
try:
    ls.load(meta, path, process_group=dist.group.WORLD)
    print("loaded")
except ls.UnsupportedValueError as exc:
    print("refused:", exc, "| meta:", meta.weight.is_meta)
dist.destroy_process_group()
"""


def test_a_sharded_load_into_meta_tensors_is_refused_saying_so(tmp_path: Path) -> None:
    """A sharded load does not give meta tensors memory (FSDP2 materializes them with
    ``to_empty`` first); it refuses them, saying what to do (one gloo rank, in a child)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", SHARDED_CHILD, str(tmp_path / "init"), str(tmp_path / "s.h5")],
        capture_output=True, text=True, env=env, timeout=120)
    assert "refused:" in done.stdout, done.stdout + done.stderr
    assert "sharded load needs them materialized" in done.stdout
    assert "| meta: True" in done.stdout


class WithRotary(torch.nn.Module):
    """A rotary embedding's ``inv_freq``: a non-persistent buffer, computed, never saved."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(2.0), persistent=False)


@pytest.mark.parametrize("suffix", BACKENDS)
def test_tensors_left_on_meta_are_named(tmp_path: Path, suffix: str) -> None:
    """The load gives memory to what the checkpoint holds; a non-persistent buffer stays on
    the meta device (as after torch's assign=True), and a warning names it, pointing at the
    caller's line, instead of a forward pass failing later. A plain model: no warning."""
    path = tmp_path / f"r{suffix}"
    ls.save(WithRotary(), path)
    with torch.device("meta"):
        meta = WithRotary()
    with pytest.warns(UserWarning, match="still on the meta device.*'inv_freq'") as caught:
        ls.load(meta, path)
    assert caught[0].filename == __file__
    assert not meta.proj.weight.is_meta and meta.inv_freq.is_meta
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ls.load(WithRotary(), path)
    train = tmp_path / f"t{suffix}"
    ls.save_training(train, model=WithRotary(), step=1)
    with torch.device("meta"):
        meta = WithRotary()
    with pytest.warns(UserWarning, match="'inv_freq'"):
        ls.load_training(train, model=meta)
