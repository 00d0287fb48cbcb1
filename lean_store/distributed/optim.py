"""Optimizer state of sharded models as flat named tensors: each moment (``exp_avg``,
``exp_avg_sq``, ...) keeps its parameter's placement, so it saves and reshards like the
parameter. Names follow parameters, not positions: ``optim.<param name>.<key>``."""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError
from ..sources.module_names import canonical_names, canonical_state

PREFIX = "optim."


def training_state(model: Any, optimizer: Any = None) -> dict[str, Any]:
    from ..sources.module_state import ModuleState

    # names as sources/module_names.py says; extra state handed to its module on load
    state = ModuleState(canonical_state(model.state_dict()), model)
    if optimizer is None:
        return state
    import torch

    named = list(model.named_parameters())
    names = dict(zip((id(p) for _, p in named), canonical_names([n for n, _ in named])))
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                raise CheckpointError("the optimizer holds a parameter the model does not have")
            for key, value in optimizer.state.get(param, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise CheckpointError(
                        f"optimizer state {name}.{key} is a {type(value).__name__}; only tensors "
                        "can be saved in a sharded checkpoint"
                    )
                state[f"{PREFIX}{name}.{key}"] = value
    return state


def init_optimizer_state(optimizer: Any) -> None:
    """One step with zero gradients and a learning rate of 0 creates every state tensor; the
    parameters are unchanged (a zero update; AdamW's decay factor is exactly 1)."""
    import torch

    params = [p for g in optimizer.param_groups for p in g["params"] if p not in optimizer.state]
    if not params:
        return
    saved = [(g, g["lr"]) for g in optimizer.param_groups]
    grads = {id(p): p.grad for p in params}
    try:
        for g in optimizer.param_groups:
            g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for g, lr in saved:
            g["lr"] = lr
        for p in params:
            p.grad = grads[id(p)]
