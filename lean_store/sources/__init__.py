"""Where state comes from and goes back to. Only the modules of torch objects import torch
(:mod:`.torch_source`, :mod:`.module_state`, :mod:`.packed_fp4`, :mod:`.optimizer`,
:mod:`.rng`), each when first used: ``import lean_store`` does not."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

from ..layout import Layout
from .base import TargetTensor, TensorSource
from .numpy_source import MappingSource, is_array_mapping, non_array_entry


def is_torch_state(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    if isinstance(obj, (torch.nn.Module, torch.Tensor)):
        return True
    if isinstance(obj, Mapping) and obj and any(isinstance(v, torch.Tensor)
                                                for v in obj.values()):
        return True  # a dict, or any mapping (MappingProxyType, UserDict, ...) holding tensors
    return False


def layout_of(obj: Any) -> Layout:
    """The layout of a torch module, a state dict, a mapping of arrays or ``Encoded``."""
    return obj if isinstance(obj, Layout) else tensor_source(obj).layout


def template_layout(obj: Any) -> Layout:
    """The layout a load checks against (``like=``): :func:`layout_of`, where meta tensors
    (shapes and dtypes without memory) stand for the tensors they describe."""
    if is_torch_state(obj):
        from .torch_source import TorchSource

        return TorchSource(obj, meta_ok=True).layout
    return layout_of(obj)


def tensor_source(obj: Any) -> TensorSource:
    """A :class:`TensorSource` for a torch module, a state dict or a mapping of arrays."""
    if isinstance(obj, TensorSource):
        return obj
    if is_torch_state(obj):
        from .torch_source import TorchSource

        return TorchSource(obj)
    if is_array_mapping(obj):
        return MappingSource(obj)
    from ..errors import CheckpointError, UnsupportedValueError

    if isinstance(obj, Mapping) and obj:
        why = non_array_entry(obj)
        if why is not None:
            raise UnsupportedValueError(why)
    raise CheckpointError(
        f"cannot take state from a {type(obj).__name__}: pass a torch.nn.Module, a state dict, "
        "or a mapping of names to numpy arrays, torch tensors or lean_store.Encoded"
    )


def after_load(obj: Any, targets: Iterable[TargetTensor], stacklevel: int) -> None:
    """What a load into ``obj`` says once done: when it gave a module's meta tensors memory,
    the module's tensors still on the meta device (:func:`.meta_tensors.warn_meta_left`)."""
    if any(target.gave_memory for target in targets):
        from .meta_tensors import warn_meta_left
        from .torch_source import unwrapped

        warn_meta_left(unwrapped(obj), stacklevel + 1)


def tensor_targets(obj: Any) -> dict[str, TargetTensor]:
    """Writable targets for in-place loading, keyed by name."""
    if is_torch_state(obj):
        from .torch_source import torch_targets

        return torch_targets(obj)
    from .numpy_source import numpy_targets

    return numpy_targets(obj)


__all__ = ["TargetTensor", "TensorSource", "after_load", "template_layout", "tensor_source",
           "tensor_targets"]
