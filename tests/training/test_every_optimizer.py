"""Every optimizer torch.optim ships resumes bit for bit from a training checkpoint: saved after
some steps, loaded into a fresh optimizer and model, both runs continue identically. LBFGS keeps
lists of tensors (its direction and step histories, ``al`` with ``None`` entries while the
history fills): they are stored as state trees (docs/FORMAT.md 7) where they were refused
before ("is a list; lean_store stores optimizer state made of tensors and numbers only")."""

from __future__ import annotations

import pytest
from torch_optional import require_torch

torch = require_torch()

import lean_store as ls  # noqa: E402

OPTIMIZERS = {
    "Adadelta": lambda p: torch.optim.Adadelta(p),
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "Adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "AdamW-amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=1e-2),
    "LBFGS": lambda p: torch.optim.LBFGS(p, lr=0.5, history_size=3, max_iter=4),
    "LBFGS-strong-wolfe": lambda p: torch.optim.LBFGS(p, history_size=5,
                                                      line_search_fn="strong_wolfe"),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2, decoupled_weight_decay=True),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.9, centered=True),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
    "SGD-nesterov": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
}
X = torch.linspace(-1, 1, 40).reshape(10, 4)
Y = torch.sin(X[:, :2])


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (model(X) - Y).pow(2).mean()
        loss.backward()
        return loss

    for _ in range(n):
        opt.step(closure)


def _bits(model: torch.nn.Module) -> list[bytes]:
    return [p.detach().numpy().tobytes() for p in model.parameters()]


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_torch_optimizer_resumes_exactly(tmp_path, suffix, name) -> None:
    if name == "Adafactor" and not hasattr(torch.optim, "Adafactor"):  # torch >= 2.5
        pytest.skip("this torch has no Adafactor")
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    _steps(model, opt, 3)
    path = tmp_path / f"t{suffix}"
    ls.save_training(path, model=model, optimizer=opt, step=3)
    _steps(model, opt, 2)  # the uninterrupted run

    fresh = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    fresh_opt = OPTIMIZERS[name](fresh.parameters())
    ls.load_training(path, model=fresh, optimizer=fresh_opt)
    _steps(fresh, fresh_opt, 2)
    assert _bits(fresh) == _bits(model)


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_lbfgs_histories_are_stored_as_tensors(tmp_path, suffix) -> None:
    model = _model()
    opt = OPTIMIZERS["LBFGS"](model.parameters())
    _steps(model, opt, 2)
    path = tmp_path / f"o{suffix}"
    ls.save_optimizer(opt, path, model=model)
    with ls.open(path) as ck:
        dirs = [n for n in ck.layout.names() if n.startswith("optimizer/state/0.weight/old_dirs/")]
    assert len(dirs) == len(opt.state_dict()["state"][0]["old_dirs"]) > 0
    fresh = OPTIMIZERS["LBFGS"](model.parameters())
    ls.load_optimizer(fresh, path, model=model)
    got, want = fresh.state_dict()["state"][0], opt.state_dict()["state"][0]
    assert got.keys() == want.keys()
    for key in ("old_dirs", "old_stps", "ro", "al"):
        assert len(got[key]) == len(want[key])
        for a, b in zip(got[key], want[key]):
            assert (a is None and b is None) or torch.equal(a, b), key
