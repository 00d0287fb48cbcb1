"""A module's state entries that are not the memory of its parameters or buffers.

``module.state_dict()`` holds views of the module's parameters and persistent buffers, which an
in-place load fills, and values the module makes when asked: what ``get_extra_state()``
returns (TransformerEngine's FP8 scaling state: a serialized uint8 tensor whose length changes
as training goes, 4 bytes in a fresh module) and entries a state-dict hook builds
(bitsandbytes' quantization state, a hook's cast copy). Words copied into those change nothing
in the module. torch's ``load_state_dict`` hands extra state to the module's
``set_extra_state`` and hook-made entries to the module's own load hooks.

lean_store does the same for extra state: it is loaded as the tensor that was saved (its
stored shape and format, checked like every tensor, not cast) and handed to
``set_extra_state`` once every tensor of the load is installed (``torch_source.ExtraStateTarget``).
An entry a hook made cannot be handed back, so a load into it is refused before anything is
changed (:func:`check_own_memory`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointError, UnsupportedValueError
from .module_names import canonical_name

EXTRA_STATE = "_extra_state"


def _overrides(module: torch.nn.Module, method: str) -> bool:
    return getattr(type(module), method, None) is not getattr(torch.nn.Module, method)


def extra_state_owners(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The name of each extra-state entry of ``module``'s state (lean_store's spelling: no
    ``_orig_mod``) -> the submodule whose ``get_extra_state`` made it (a submodule reached by
    two paths is listed under each, as ``state_dict`` names it)."""
    owners: dict[str, torch.nn.Module] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        if _overrides(sub, "get_extra_state"):
            name = f"{prefix}.{EXTRA_STATE}" if prefix else EXTRA_STATE
            owners[canonical_name(name)] = sub
    return owners


class ModuleState(dict[str, Any]):
    """A module's state (and more, e.g. optimizer moments) as a plain dict that remembers which
    of its entries are extra state and which submodule each belongs to
    (:attr:`extra_state_owners`), so that a load into the dict hands them over as a load into
    the module does (``lean_store.distributed.training_state`` makes one)."""

    extra_state_owners: dict[str, torch.nn.Module]

    def __init__(self, items: Any, module: torch.nn.Module) -> None:
        super().__init__(items)
        self.extra_state_owners = {
            n: m for n, m in extra_state_owners(module).items() if n in self}


def owners_in(obj: Any, state: Any) -> dict[str, torch.nn.Module]:
    """The extra-state entries of ``state`` (``obj``'s state; a module without the wrappers
    that rename it) -> their submodules: those of a module, or those a :class:`ModuleState`
    remembers; none for any other mapping."""
    if isinstance(obj, torch.nn.Module):
        return {n: m for n, m in extra_state_owners(obj).items() if n in state}
    return dict(getattr(obj, "extra_state_owners", None) or {})


def check_settable(owner: torch.nn.Module, name: str) -> None:
    """Refuse a module whose extra state cannot be given back (no ``set_extra_state``)."""
    if not _overrides(owner, "set_extra_state"):
        raise UnsupportedValueError(
            f"module {type(owner).__name__} (state entry {name!r}) defines get_extra_state "
            "but not set_extra_state: its extra state cannot be loaded")


def hand_over(owner: torch.nn.Module, name: str, value: Any) -> None:
    """``owner.set_extra_state(value)``; its failure a CheckpointError naming the entry."""
    try:
        owner.set_extra_state(value)
    except Exception as exc:
        raise CheckpointError(
            f"{type(owner).__name__}.set_extra_state refused the loaded extra state {name!r} "
            f"({type(exc).__name__}: {exc}); the module's other tensors were loaded") from exc


def is_uninitialized(value: Any) -> bool:
    """A lazy module's parameter or buffer before its first forward pass or load (no shape,
    no data: ``torch.nn.parameter.UninitializedParameter`` / ``UninitializedBuffer``)."""
    return isinstance(value, torch.Tensor) and torch.nn.parameter.is_lazy(value)


def check_own_memory(module: torch.nn.Module, state: dict[str, Any],
                     extra: dict[str, torch.nn.Module]) -> None:
    """Refuse a load into ``module`` when an entry of its ``state`` (its state_dict, not its
    extra state) is neither a parameter's nor a buffer's memory: a state-dict hook made it,
    and words copied into it would not reach the module."""
    own = {t.untyped_storage().data_ptr()
           for t in (*module.parameters(), *module.buffers())
           if not is_uninitialized(t) and t.numel()}
    made = [name for name, value in state.items()
            if name not in extra and isinstance(value, torch.Tensor) and value.numel()
            and value.untyped_storage().data_ptr() not in own]
    if made:
        shown = ", ".join(repr(n) for n in made[:5]) + (" ..." if len(made) > 5 else "")
        raise UnsupportedValueError(
            f"cannot load in place into {len(made)} state entr{'y' if len(made) == 1 else 'ies'}"
            f" of the module ({shown}): {'it is' if len(made) == 1 else 'they are'} not the "
            "memory of any of its parameters or buffers (a state-dict hook made them, e.g. "
            "quantization state), so the loaded words would not reach the module; load with "
            "ls.load_state(path, like=module) and module.load_state_dict(...), which hands them "
            "to the module's own load hooks")
