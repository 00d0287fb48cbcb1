"""Tied weights (``lm_head.weight`` is ``embed.weight``): a file that holds one of the two names
(what Hugging Face's ``save_pretrained`` and safetensors' ``save_model`` write) loads into the
tied model strictly, the missing name loaded through its twin, as safetensors' ``load_model``
loads it. Before, ``ls.load`` refused it as a missing tensor. A name that is missing and tied
to nothing stays a missing tensor."""

from __future__ import annotations

import numpy as np
import pytest
from torch_optional import require_torch

torch = require_torch()

import lean_store as ls  # noqa: E402
from lean_store.interop.convert import convert  # noqa: E402


class TiedLM(torch.nn.Module):
    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.lm_head = torch.nn.Linear(6, 11, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_file_holding_one_of_two_tied_names_loads_strictly(tmp_path, suffix) -> None:
    from safetensors.torch import save_model

    torch.manual_seed(0)
    model = TiedLM()
    save_model(model, str(tmp_path / "model.safetensors"))  # keeps one of the tied names
    out = tmp_path / f"model{suffix}"
    layout = convert(tmp_path / "model.safetensors", out)
    assert len([n for n in layout.names() if n in ("embed.weight", "lm_head.weight")]) == 1
    fresh = TiedLM()
    result = ls.load(fresh, out)
    assert fresh.lm_head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    assert sorted(result.loaded) == sorted(model.state_dict()) and result.missing == []


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_training_resume_of_a_tied_model_from_a_file_with_one_name(tmp_path, suffix) -> None:
    """A model that leaves its tied name out of its state dict (a state-dict hook, as
    transformers' ``_keys_to_ignore_on_save``) saves a training checkpoint without it; a fresh
    model, without the hook, resumes from it strictly."""
    torch.manual_seed(1)
    model = TiedLM()

    def drop_tied(module, state, prefix, local_metadata):
        state.pop(prefix + "lm_head.weight", None)

    model._register_state_dict_hook(drop_tied)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.lm_head(model.norm(model.embed(torch.tensor([1, 2])))).sum().backward()
    opt.step()
    path = tmp_path / f"t{suffix}"
    ls.save_training(path, model=model, optimizer=opt, step=1)
    fresh = TiedLM()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with ls.open(path) as ck:
        assert "model/lm_head.weight" not in ck.layout and "model/embed.weight" in ck.layout
    ls.load_training(path, model=fresh, optimizer=fresh_opt)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["momentum_buffer"],
                       opt.state_dict()["state"][0]["momentum_buffer"])


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_an_untied_missing_name_is_still_missing(tmp_path, suffix) -> None:
    model = TiedLM()
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    ls.save(state, tmp_path / f"m{suffix}")
    untied = TiedLM(tie=False)
    before = untied.lm_head.weight.detach().clone()
    with pytest.raises(ls.LayoutError, match="lm_head.weight"):
        ls.load(untied, tmp_path / f"m{suffix}")
    assert torch.equal(untied.lm_head.weight, before)
    # a view of another tensor (not the same memory, shape and strides) is not its twin
    base = np.zeros((4, 4), np.float32)
    ls.save({"a": np.ones((4, 4), np.float32)}, tmp_path / f"v{suffix}")
    with pytest.raises(ls.LayoutError, match="'b'"):
        ls.load({"a": base, "b": base[:2]}, tmp_path / f"v{suffix}")
