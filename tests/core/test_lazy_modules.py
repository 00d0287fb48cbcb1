"""Lazy modules (``torch.nn.LazyLinear``, ``LazyBatchNorm1d``, ...): a fresh one has
uninitialized parameters (no shape, no data). torch's ``load_state_dict`` materializes them with
the saved shapes; ``ls.load`` (and ``load_training``, ``Checkpointer.restore``) now does too,
after the whole checkpoint is validated, with the parameters' own dtype checked like any
target's. Before, every such load failed with torch's raw ``ValueError`` ("Attempted to use an
uninitialized parameter"), and a save of a lazy module with a raw ``RuntimeError``; a save is now
refused by name, as there is nothing to store yet."""

from __future__ import annotations

import pytest
from torch_optional import require_torch

torch = require_torch()

import lean_store as ls  # noqa: E402

BACKENDS = [".h5", ".zarr"]
pytestmark = pytest.mark.filterwarnings("ignore:Lazy modules are a new feature")


class Net(torch.nn.Module):
    def __init__(self, lazy: bool) -> None:
        super().__init__()
        self.a = torch.nn.LazyLinear(8) if lazy else torch.nn.Linear(3, 8)
        self.bn = torch.nn.LazyBatchNorm1d() if lazy else torch.nn.BatchNorm1d(8)
        self.c = torch.nn.LazyLinear(2) if lazy else torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.bn(self.a(x)))


def _trained() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Net(lazy=False)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(6, 3)).square().sum().backward()
        opt.step()
    return net, opt


def _uninitialized(module: torch.nn.Module) -> bool:
    return any(isinstance(p, torch.nn.parameter.UninitializedTensorMixin)
               for p in (*module.parameters(), *module.buffers()))


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("suffix", BACKENDS)
def test_load_materializes_lazy_parameters_with_the_stored_shapes(tmp_path, suffix):
    net, _ = _trained()
    path = tmp_path / f"net{suffix}"
    ls.save(net, path)
    lazy = Net(lazy=True)
    result = ls.load(lazy, path)
    assert not _uninitialized(lazy)
    assert len(result.loaded) == len(net.state_dict())
    assert _same_state(net, lazy)
    # what torch's own load_state_dict gives, and a forward pass that behaves the same
    reference = Net(lazy=True)
    reference.load_state_dict(net.state_dict())
    assert _same_state(reference, lazy)
    net.eval()
    lazy.eval()
    x = torch.randn(5, 3)
    assert torch.equal(net(x), lazy(x))
    assert type(lazy.a) is torch.nn.Linear  # the module becomes what it would have become


@pytest.mark.parametrize("suffix", BACKENDS)
def test_a_lazy_parameter_keeps_its_dtype_checked_and_nothing_materializes_on_error(
        tmp_path, suffix):
    net, _ = _trained()
    path = tmp_path / f"f64{suffix}"
    ls.save({k: v.double() if v.is_floating_point() else v
             for k, v in net.state_dict().items()}, path)
    lazy = Net(lazy=True)
    with pytest.raises(ls.LayoutError, match=r"'a\.weight': format expected float32"):
        ls.load(lazy, path)
    assert _uninitialized(lazy)  # validated first: nothing was materialized
    cast = {k: "float32" for k, v in net.state_dict().items() if v.is_floating_point()}
    ls.load(lazy, path, cast=cast)
    assert lazy.a.weight.dtype == torch.float32
    assert torch.equal(lazy.a.weight, net.a.weight.double().float())


@pytest.mark.parametrize("suffix", BACKENDS)
def test_a_missing_entry_leaves_its_lazy_parameter_uninitialized_when_not_strict(
        tmp_path, suffix):
    path = tmp_path / f"bias{suffix}"
    ls.save({"bias": torch.arange(8.0)}, path)
    lazy = torch.nn.LazyLinear(8)
    with pytest.raises(ls.LayoutError, match="weight"):
        ls.load(lazy, path)
    assert lazy.has_uninitialized_params()
    with pytest.warns(UserWarning, match="weight"):
        result = ls.load(lazy, path, strict=False)
    assert result.missing == ["weight"]
    assert torch.equal(lazy.bias, torch.arange(8.0))
    assert isinstance(lazy.weight, torch.nn.parameter.UninitializedParameter)


@pytest.mark.parametrize("suffix", BACKENDS)
def test_training_resume_into_a_lazy_model_and_its_optimizer(tmp_path, suffix):
    net, opt = _trained()
    path = tmp_path / f"train{suffix}"
    ls.save_training(path, model=net, optimizer=opt, step=2)
    lazy = Net(lazy=True)
    lazy_opt = torch.optim.AdamW(lazy.parameters(), lr=0.5)  # built over uninitialized params
    ls.load_training(path, model=lazy, optimizer=lazy_opt)
    assert _same_state(net, lazy)
    sa, sb = opt.state_dict(), lazy_opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, moments in sa["state"].items():
        for key, value in moments.items():
            assert torch.equal(value, sb["state"][i][key]), (i, key)
    # both take the same next step
    x = torch.randn(4, 3)
    for model, o in ((net, opt), (lazy, lazy_opt)):
        o.zero_grad()
        model(x).square().sum().backward()
        o.step()
    assert _same_state(net, lazy)


@pytest.mark.parametrize("suffix", BACKENDS)
def test_checkpointer_restores_into_a_lazy_model(tmp_path, suffix):
    net, opt = _trained()
    backend = "zarr" if suffix == ".zarr" else "hdf5"
    ls.Checkpointer(tmp_path / "run", backend=backend).save(1, model=net, optimizer=opt)
    lazy = Net(lazy=True)
    lazy_opt = torch.optim.AdamW(lazy.parameters(), lr=0.01)
    ls.Checkpointer(tmp_path / "run", backend=backend).restore(model=lazy, optimizer=lazy_opt)
    assert _same_state(net, lazy)


@pytest.mark.parametrize("suffix", BACKENDS)
def test_saving_an_uninitialized_lazy_module_is_refused_by_name(tmp_path, suffix):
    path = tmp_path / f"lazy{suffix}"
    with pytest.raises(ls.UnsupportedValueError, match=r"'a\.weight' is an uninitialized"):
        ls.save(Net(lazy=True), path)
    assert not path.exists()
    ls.save(_trained()[0], path)
    with pytest.raises(ls.UnsupportedValueError, match="lean_store.load"):
        ls.load_state(path, like=Net(lazy=True))
