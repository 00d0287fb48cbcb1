"""A PyTorch Lightning ``CheckpointIO`` plugin that writes lean_store checkpoints.

>>> import lightning.pytorch as pl
>>> import lean_store.interop.lightning
>>> trainer = pl.Trainer(plugins=[lean_store.interop.lightning.CheckpointIO()])          # HDF5
>>> trainer = pl.Trainer(plugins=[lean_store.interop.lightning.CheckpointIO(backend="zarr")])

Lightning's checkpoint dict is stored without pickle: every tensor and numpy array (model
``state_dict``, ``optimizer_states`` moments and steps, callback scores, ...) becomes a chunked,
checksummed dataset, and the plain data around them (epochs, loop progress, hyperparameters,
param groups, scheduler state) is JSON in the root attribute ``lightning``, written with the
pickle-free state-tree codec the training checkpoints use (:mod:`lean_store.statetree`). Any
other object is refused with a :class:`CheckpointError` naming its key, before a file exists.

Lightning names checkpoints ``epoch=1-step=10.ckpt``; the store is chosen by ``backend`` (default
``"hdf5"``: one file; ``"zarr"``: a directory, or an ``s3://`` prefix with ``dirpath`` a URL),
never by the suffix. Reading detects the store from the content. Only this module imports
``lightning`` (``lightning.pytorch``, 2.x).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _LightningCheckpointIO

from ..checkpoint import Checkpoint
from ..errors import CheckpointError, IntegrityError
from ..statetree import decode, encode, tensor_names
from ..stores.registry import BACKENDS, is_url
from ..writing import write_source

LIGHTNING_FORMAT_VERSION = 1
VERSION_ATTR = "lightning_format_version"
META_ATTR = "lightning"


class CheckpointIO(_LightningCheckpointIO):
    """Save, load and remove Lightning checkpoints as lean_store HDF5 or Zarr checkpoints.

    ``backend``: ``"hdf5"`` (default) or ``"zarr"``; ``compression`` and ``chunk_bytes`` as for
    :func:`lean_store.save`.
    """

    def __init__(self, backend: str = "hdf5", *, compression: Any = None,
                 chunk_bytes: int | None = None) -> None:
        if backend not in BACKENDS:
            raise CheckpointError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
        self.backend = backend
        self.compression = compression
        self.chunk_bytes = chunk_bytes

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically (creating its directory, as Lightning's
        own plugin does); refuse what is not plain data or tensors before writing anything."""
        from ..sources import tensor_source

        if storage_options is not None:
            raise CheckpointError(
                "lean_store.interop.lightning.CheckpointIO takes no storage_options; pass backend, "
                "compression and chunk_bytes to its constructor"
            )
        tensors: dict[str, Any] = {}
        meta = encode_checkpoint(checkpoint, tensors)
        text = json.dumps(meta, separators=(",", ":"), allow_nan=False)
        if not is_url(path):
            Path(path).parent.mkdir(parents=True, exist_ok=True)  # as Lightning's own plugin
        write_source(
            tensor_source(tensors), path, kind="state", backend=self.backend,
            chunk_bytes=self.chunk_bytes, compression=self.compression,
            extra_root={VERSION_ATTR: LIGHTNING_FORMAT_VERSION, META_ATTR: text},
        )

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint written by :meth:`save_checkpoint`; every tensor is checked
        against its checksums before the dict is returned. Tensors are created on the CPU,
        or on ``map_location`` (a device, a device string, or a dict mapping ``"cpu"``).
        Nothing is unpickled, so ``weights_only`` is accepted and has no effect."""
        device = _device(map_location)
        with Checkpoint(path) as ck:
            meta = read_metadata(ck)
            return decode_checkpoint(ck, meta, device)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Delete a checkpoint (a file, a Zarr directory or a URL prefix); a missing path is
        not an error."""
        if is_url(path):
            import fsspec

            fs, root = fsspec.core.url_to_fs(str(path))
            if fs.exists(root):
                fs.rm(root, recursive=True)
            return
        p = Path(path)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


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
                              f"(no {VERSION_ATTR!r} attribute)")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise IntegrityError(f"{ck.path}: malformed {VERSION_ATTR} {version!r}")
    if version > LIGHTNING_FORMAT_VERSION:
        raise IntegrityError(f"{ck.path}: Lightning format version {version} is newer than this "
                             f"lean_store (reads up to {LIGHTNING_FORMAT_VERSION})")
    text = attrs.get(META_ATTR)
    try:
        meta = json.loads(text) if isinstance(text, str) else text
    except ValueError as exc:
        raise IntegrityError(f"{ck.path}: the {META_ATTR!r} attribute is not JSON ({exc})"
                             ) from None
    if not isinstance(meta, dict):
        raise IntegrityError(f"{ck.path}: the {META_ATTR!r} attribute is not a JSON object")
    missing = sorted({name for _, name in tensor_names(meta) if name not in ck.layout})
    if missing:
        raise IntegrityError(f"{ck.path}: the checkpoint names tensors it does not hold: {missing}")
    return meta


def decode_checkpoint(ck: Checkpoint, meta: dict[str, Any], device: Any) -> dict[str, Any]:
    """Inverse of :func:`encode_checkpoint`, reading verified tensors from ``ck``."""
    from ..checkpoint import as_values
    from ..sources.torch_source import dtype_of_format, new_tensor

    def lookup(kind: str, name: str) -> Any:
        entry = ck.layout[name]
        words = ck.read_bits(name)
        if kind == "tensor":
            if dtype_of_format(entry.format) is None:
                raise IntegrityError(f"tensor {name!r} is {entry.format.tag}, which torch "
                                     "cannot hold")
            return new_tensor(words, entry.format, entry.shape, device)
        values = as_values(words, entry.format)
        if kind == "scalar":
            if entry.shape != () or not hasattr(values, "dtype"):
                raise IntegrityError(f"tensor {name!r} is not a numpy scalar")
            return values[()]
        return values

    return {key: decode(value, lookup, str(ck.path)) for key, value in meta.items()}


def _device(map_location: Any) -> Any:
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


__all__ = ["CheckpointIO", "LIGHTNING_FORMAT_VERSION"]
