"""The names a module's tensors are stored under: without what wrappers add.

``torch.compile(model)`` returns a wrapper that holds the model as its submodule ``_orig_mod``,
so every name its ``state_dict()`` and ``named_parameters()`` give starts with ``_orig_mod.``
(and ``torch.compile`` applied to a submodule adds the component in the middle of a name);
``DistributedDataParallel`` and ``DataParallel`` hold it as ``module``. A checkpoint named that
way loads only into the model wrapped the same way, not into the model alone. lean_store names
a module's tensors without those parts, as DCP's ``get_state_dict`` and Lightning do: the
``_orig_mod`` components are left out here (:func:`canonical_state`), and the parallel wrappers
are taken off by :func:`lean_store.sources.torch_source.unwrapped` (by their class: a module
of one's own may be called ``module``). Checkpoints saved before with those names still load:
a load follows the checkpoint's spelling of a name (:func:`spelled_as`).

Strings only: this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

from ..errors import CheckpointError

WRAPPED = "_orig_mod"
"""The name under which torch.compile's wrapper module holds the compiled module."""
PARALLEL = "module."
"""What DistributedDataParallel and DataParallel put in front of every name."""

V = TypeVar("V")


def canonical_name(name: str) -> str:
    """``name`` without its ``_orig_mod`` components (``_orig_mod.0.weight`` -> ``0.weight``;
    ``blocks.0._orig_mod.w`` -> ``blocks.0.w``)."""
    if WRAPPED not in name:
        return name
    return ".".join(part for part in name.split(".") if part != WRAPPED)


def canonical_state(state: Mapping[str, V]) -> Mapping[str, V]:
    """``state`` keyed by canonical names (``state`` itself when no name changes). Two names
    that become one (a module holding both ``x`` and ``_orig_mod.x``) raise CheckpointError."""
    if not any(WRAPPED in name for name in state):
        return state
    renamed: dict[str, V] = {}
    for name, value in state.items():
        key = canonical_name(name)
        if key in renamed:
            raise CheckpointError(
                f"the module's tensors {key!r} and {name!r} have the same name once the "
                f"{WRAPPED!r} components torch.compile adds are left out")
        renamed[key] = value
    return renamed


def canonical_names(names: Sequence[str]) -> list[str]:
    """:func:`canonical_name` of each of ``names`` (a collision raises as in
    :func:`canonical_state`)."""
    return list(canonical_state(dict.fromkeys(names)))


def spelled_as(names: Iterable[str], stored: Iterable[str]) -> dict[str, str]:
    """For each of ``names`` (a module's, as lean_store names them) that a checkpoint stores
    only under a name a wrapper made (saved before lean_store left those parts out): that
    stored name. A name with ``_orig_mod`` components; or ``module.`` and the name, when every
    stored name starts with ``module.`` (a DistributedDataParallel or DataParallel module's
    state). Empty when the checkpoint has no such name."""
    stored = list(stored)
    parallel = bool(stored) and all(name.startswith(PARALLEL) for name in stored)
    if not parallel and not any(WRAPPED in name for name in stored):
        return {}
    present = set(stored)
    by_canonical: dict[str, str] = {}
    for name in stored:
        bare = name[len(PARALLEL):] if parallel else name
        if WRAPPED in bare or parallel:
            by_canonical.setdefault(canonical_name(bare), name)
    return {name: by_canonical[name] for name in names
            if name not in present and name in by_canonical}


def spelled_under(names: Iterable[str], stored: Iterable[str], prefix: str) -> dict[str, str]:
    """:func:`spelled_as` against the stored names under ``prefix`` (``model/`` of a training
    checkpoint), the prefix left off on both sides."""
    return spelled_as(names, [name[len(prefix):] for name in stored if name.startswith(prefix)])


def respelled(mapping: Mapping[str, V], spelling: Mapping[str, str]) -> dict[str, V]:
    """``mapping`` with each key that ``spelling`` names renamed to its spelling, in order."""
    return {spelling.get(name, name): value for name, value in mapping.items()}


__all__ = ["PARALLEL", "WRAPPED", "canonical_name", "canonical_names", "canonical_state",
           "respelled", "spelled_as", "spelled_under"]
