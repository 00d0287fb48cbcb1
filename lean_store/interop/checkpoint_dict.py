"""A torch checkpoint dict as a lean_store checkpoint, without pickle.

A dict of plain data and tensors, as training scripts ``torch.save`` it (``{"model": ...,
"optimizer": ..., "epoch": 3}``) and as Lightning's ``.ckpt`` holds it, is stored with every
tensor a chunked, checksummed dataset named by its key path (``model/layer.weight``,
``optimizer/state/0/exp_avg``) and the plain data around them as JSON in the root attribute
``lightning``, written with the pickle-free state-tree codec of the training checkpoints
(:mod:`lean_store.statetree`; docs/FORMAT.md 7.2). The layout is the one
:class:`lean_store.interop.lightning.CheckpointIO` writes (hence the attribute names), and
:func:`load_checkpoint_dict` reads any such file back as the same dict, without importing
Lightning. ``lean-store convert`` writes it for a torch file whose top level is such a dict.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ..checkpoint import Checkpoint
from ..errors import CheckpointError, IntegrityError
from ..hardening import check_json_depth
from ..layout import Entry, Layout
from ..statetree import JSON_DEPTH, decode, encode, tensor_names

LIGHTNING_FORMAT_VERSION = 1
VERSION_ATTR = "lightning_format_version"
META_ATTR = "lightning"


def load_checkpoint_dict(path: str | os.PathLike, map_location: Any | None = None
                         ) -> dict[str, Any]:
    """The checkpoint dict stored at ``path`` (by ``lean-store convert`` of a torch checkpoint
    dict, or by the Lightning plugin), every tensor checked against its checksums. Tensors are
    created on the CPU, or on ``map_location`` (a device, a device string, or a dict mapping
    ``"cpu"``, as ``torch.load`` takes it)."""
    device = map_device(map_location)
    with Checkpoint(path) as ck:
        return decode_checkpoint(ck, read_metadata(ck), device)


def metadata_text(checkpoint: Any, tensors: dict[str, Any]) -> str:
    """The ``lightning`` root attribute of ``checkpoint``; its tensors go to ``tensors``."""
    meta = encode_checkpoint(checkpoint, tensors)
    return json.dumps(meta, separators=(",", ":"), allow_nan=False)


def encode_checkpoint(checkpoint: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    """The JSON form of a Lightning checkpoint dict; its tensors go to ``tensors`` by key path
    (``state_dict/layer.weight``, ``optimizer_states/0/state/0/exp_avg``, ...)."""
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"a Lightning checkpoint is a dict, got {type(checkpoint).__name__}")
    bad = [k for k in checkpoint if not isinstance(k, str) or not k or k.startswith("$")]
    if bad:
        raise CheckpointError(f"checkpoint keys must be non-empty strings, got {bad!r}")
    return {key: encode(value, key, tensors) for key, value in checkpoint.items()}


def read_metadata(ck: Checkpoint) -> dict[str, Any]:
    """The checkpoint's JSON tree, after checking it is a Lightning checkpoint of a known
    version that names only tensors the file holds."""
    attrs = ck.root_attrs
    version = attrs.get(VERSION_ATTR)
    if version is None:
        raise CheckpointError(f"{ck.path} is a lean_store checkpoint but not a Lightning one "
                              f"or any other checkpoint dict (no {VERSION_ATTR!r} attribute): "
                              "read its tensors with lean_store.load_state")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise IntegrityError(f"{ck.path}: malformed {VERSION_ATTR} {version!r}")
    if version > LIGHTNING_FORMAT_VERSION:
        raise IntegrityError(f"{ck.path}: Lightning format version {version} is newer than this "
                             f"lean_store (reads up to {LIGHTNING_FORMAT_VERSION})")
    meta = parse_metadata(attrs.get(META_ATTR), f"{ck.path}: the {META_ATTR!r} attribute")
    missing = sorted({name for _, name in tensor_names(meta) if name not in ck.layout})
    if missing:
        raise IntegrityError(f"{ck.path}: the checkpoint names tensors it does not hold: {missing}")
    return meta


def parse_metadata(text: Any, where: str) -> dict[str, Any]:
    """The JSON object of a :data:`META_ATTR` attribute (checked for depth before parsing)."""
    if isinstance(text, str):
        check_json_depth(text, where, JSON_DEPTH)
    try:
        meta = json.loads(text) if isinstance(text, str) else text
    except ValueError as exc:
        raise IntegrityError(f"{where} is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise IntegrityError(f"{where} is not a JSON object")
    return meta


def decode_checkpoint(ck: Checkpoint, meta: dict[str, Any], device: Any) -> dict[str, Any]:
    """Inverse of :func:`encode_checkpoint`, reading verified tensors from ``ck``."""
    return decode_tensors(meta, ck.layout, lambda entry: ck.read_bits(entry.name), device,
                          str(ck.path))


def decode_tensors(meta: dict[str, Any], layout: Layout, read_words: Callable[[Entry], Any],
                   device: Any, where: str) -> dict[str, Any]:
    """The checkpoint dict of ``meta`` with its tensors from ``read_words`` (the words of an
    entry of ``layout``): torch tensors on ``device``, numpy arrays and scalars as saved."""
    from ..checkpoint import as_values
    from ..sources.torch_source import dtype_of_format, new_tensor

    def lookup(kind: str, name: str) -> Any:
        if name not in layout:
            raise IntegrityError(f"{where}: the checkpoint dict names tensor {name!r}, which "
                                 "is missing")
        entry = layout[name]
        words = np.ascontiguousarray(read_words(entry))
        if not words.flags.writeable:  # e.g. a memory-mapped input: the new value owns a copy
            words = words.copy()
        if kind == "tensor":
            if dtype_of_format(entry.format) is None:
                raise IntegrityError(f"tensor {name!r} is {entry.format.tag}, which torch "
                                     "cannot hold")
            tensor = new_tensor(words, entry.format, entry.shape, device)
            if tensor.numel() == 0:  # the standard strides (torch.save records them)
                tensor = tensor.new_empty(entry.shape)
            return tensor
        values = as_values(words, entry.format)
        if kind == "scalar":
            if entry.shape != () or not hasattr(values, "dtype"):
                raise IntegrityError(f"tensor {name!r} is not a numpy scalar")
            return values[()]
        return values

    return {key: decode(value, lookup, where) for key, value in meta.items()}


def map_device(map_location: Any) -> Any:
    """The device tensors are created on: torch.load's ``map_location`` for CPU-saved data."""
    import torch

    if map_location is None:
        return torch.device("cpu")
    if isinstance(map_location, dict):
        map_location = map_location.get("cpu", "cpu")
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    raise CheckpointError(
        f"map_location {map_location!r} is not supported: pass None, a device, a device string "
        "or a dict mapping 'cpu' to one (a function needs torch storages, which lean_store does "
        "not create)"
    )




__all__ = ["LIGHTNING_FORMAT_VERSION", "load_checkpoint_dict"]
