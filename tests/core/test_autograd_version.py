"""``ls.load`` writes parameters in place through numpy, behind autograd's back; it now counts
the write as the in-place change it is (``torch.autograd.graph.increment_version``), so a
graph that saved the old values fails at ``backward`` as it does after torch's
``load_state_dict``. Before, backward silently computed gradients from the loaded weights."""

from __future__ import annotations

import pytest
from torch_optional import require_torch

torch = require_torch()

import lean_store as ls  # noqa: E402


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_graph_over_the_old_weights_fails_at_backward_as_with_torch(tmp_path, suffix) -> None:
    source = torch.nn.Linear(3, 1)
    ls.save(source, tmp_path / f"w{suffix}")
    x = torch.randn(2, 3, requires_grad=True)

    reference = torch.nn.Linear(3, 1)
    y = (reference(x) ** 2).sum()
    reference.load_state_dict(source.state_dict())
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as torch_error:
        y.backward()

    model = torch.nn.Linear(3, 1)
    y = (model(x) ** 2).sum()
    before = model.weight._version
    ls.load(model, tmp_path / f"w{suffix}")
    assert model.weight._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as ours:
        y.backward()
    assert type(ours.value) is type(torch_error.value)
    # a new graph over the loaded weights is fine, and equal to the source's
    x.grad = None
    (model(x) ** 2).sum().backward()
    grad = x.grad.clone()
    x.grad = None
    (source(x) ** 2).sum().backward()
    assert torch.equal(grad, x.grad)
