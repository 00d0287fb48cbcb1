"""A module's meta tensors, materialized by a load.

A model too big to initialise twice is built on the meta device (``with torch.device("meta")``,
accelerate's ``init_empty_weights``, Hugging Face's ``low_cpu_mem_usage``): its parameters
and buffers have shapes and dtypes but no memory, and the checkpoint's values are then put in
with ``model.load_state_dict(state, assign=True)``. ``lean_store.load`` does the same for a
module's meta tensors: each is validated like any target (shape and format from the meta
tensor), and once the whole checkpoint is checked it gets CPU memory in place
(``torch.utils.swap_tensors``: the module, a tied twin and an optimizer keep the same object,
its class, ``requires_grad`` and Python attributes stay) just before its words are installed.
If any of them cannot be swapped (a view of it is held), those already swapped are swapped
back and nothing is installed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..chunking import Region
from ..errors import UnsupportedValueError
from ..layout import Entry
from .base import TargetTensor
from .module_names import canonical_name


def is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


def meta_entries(module: Any, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The entries of ``state`` (``module``'s state dict, lean_store's names) that are meta
    tensors -> the module's own parameter or buffer object of that name (``state_dict()``
    holds detached aliases, which a swap would not reach). An entry no parameter or buffer
    has (a state-dict hook made it) is left out, and refused as any meta tensor is."""
    wanted = {name for name, value in state.items() if is_meta(value)}
    if not wanted or not isinstance(module, torch.nn.Module):
        return {}
    own: dict[str, torch.Tensor] = {}
    for name, tensor in (*module.named_parameters(remove_duplicate=False),
                         *module.named_buffers(remove_duplicate=False)):
        key = canonical_name(name)
        if key in wanted and tensor.is_meta:
            own[key] = tensor
    for name, tensor in own.items():
        if type(tensor) not in (torch.nn.Parameter, torch.Tensor):
            raise UnsupportedValueError(
                f"state entry {name!r} is a meta tensor of class {type(tensor).__name__}: "
                "lean_store gives memory to meta parameters (torch.nn.Parameter) and buffers "
                "(torch.Tensor) only; materialize the module first (module.to_empty(device="
                "'cpu')) and load into it")
    return own


class MetaTarget(TargetTensor):
    """A module's meta parameter or buffer: given CPU memory in place by :meth:`prepare`
    (after the checkpoint is validated, before any target is written), then loaded as any
    CPU tensor."""

    def __init__(self, entry: Entry, tensor: torch.Tensor,
                 loaded_as: Callable[[Entry, torch.Tensor], TargetTensor]) -> None:
        """``loaded_as``: the target of a CPU tensor (``torch_source.TorchTarget``), which
        loads it once it has memory."""
        self.entry = entry
        self._loaded_as = loaded_as
        self._tensor = tensor
        self._meta: torch.Tensor | None = None  # what was swapped out, for undo()
        self._target: TargetTensor | None = None

    def prepare(self) -> None:
        tensor = self._tensor
        if tensor.is_meta:  # else a tied twin's target gave it memory already
            data = torch.empty(tensor.shape, dtype=tensor.dtype)
            new = torch.nn.Parameter(data, requires_grad=tensor.requires_grad) \
                if isinstance(tensor, torch.nn.Parameter) \
                else data.requires_grad_(tensor.requires_grad)
            new.__dict__.update(tensor.__dict__)  # attributes set on it (a swap exchanges them)
            try:
                torch.utils.swap_tensors(tensor, new)
            except RuntimeError as exc:
                raise UnsupportedValueError(
                    f"cannot give memory to the meta tensor {self.entry.name!r} in place "
                    f"({exc}): a view of it or another reference is held; drop it, or "
                    "materialize the module first (module.to_empty(device='cpu'))") from None
            self._meta = new  # now the meta tensor's contents
            self.gave_memory = True
        self._target = self._loaded_as(self.entry, tensor)

    def undo(self) -> None:
        if self._meta is not None:
            torch.utils.swap_tensors(self._tensor, self._meta)
            self._meta = None
        self._target = None
        self.gave_memory = False

    def write(self, region: Region, bits: np.ndarray) -> None:
        if self._target is None:
            self.prepare()
        assert self._target is not None
        self._target.write(region, bits)

    def memory(self) -> tuple[Any, ...] | None:
        """The same object for tied names (meta tensors have no address)."""
        return ("meta", id(self._tensor))


def warn_meta_left(module: Any, stacklevel: int) -> None:
    """After a load that gave meta tensors of ``module`` memory: warn naming those still on
    the meta device (non-persistent buffers, which no checkpoint holds, such as rotary
    embeddings' ``inv_freq``; tensors a ``strict=False`` load skipped): the module cannot
    run until they are computed or loaded."""
    if not isinstance(module, torch.nn.Module):
        return
    left = [canonical_name(name) for name, tensor in (
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False)) if tensor.is_meta]
    if left:
        shown = ", ".join(map(repr, left[:5])) + (" ..." if len(left) > 5 else "")
        warnings.warn(
            f"tensors of the module still on the meta device after the load ({len(left)}: "
            f"{shown}): the checkpoint does not hold them (a non-persistent buffer is never "
            "saved); compute or load them before the module runs", stacklevel=stacklevel + 1)


__all__ = ["MetaTarget", "is_meta", "meta_entries", "warn_meta_left"]
