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

import os
import shutil
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _LightningCheckpointIO

from ..checkpoint import Checkpoint
from ..errors import CheckpointError
from ..stores.registry import BACKENDS, is_url
from ..writing import write_source
from .checkpoint_dict import (
    LIGHTNING_FORMAT_VERSION,
    META_ATTR,
    VERSION_ATTR,
    decode_checkpoint,
    map_device,
    metadata_text,
    read_metadata,
)


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
        text = metadata_text(checkpoint, tensors)
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
        device = map_device(map_location)
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


__all__ = ["CheckpointIO", "LIGHTNING_FORMAT_VERSION"]
