"""The API layer: ``save``, ``save_async`` and ``load`` decide here, once, whether a call is
sharded and whether it blocks, and hand it to one path below:

- single process, blocking: :func:`lean_store.writing.write_source` /
  :func:`lean_store.checkpoint.load`;
- single process, ``blocking=False``: :func:`lean_store.async_save.start`;
- sharded (a ``process_group``, or DTensor / ``LocalShard`` values), blocking or not:
  :mod:`lean_store.distributed`.

The training verbs (:mod:`lean_store.training`) build their tensors and metadata and go through
:func:`is_sharded` and :func:`write` too. Nothing below this module imports it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .async_save import SaveHandle, start
from .checkpoint import LoadResult
from .checkpoint import load as load_single
from .errors import CheckpointError
from .gc_pause import collection_paused
from .layout import Layout
from .options import SaveOptions, merge_options, refuse
from .sources import tensor_source
from .stores.commit import at_call_time
from .stores.registry import backend_for, backend_record, checkpoint_path
from .writing import write_source


def is_sharded(process_group: Any, *objs: Any) -> bool:
    """True when a save or load must go through :mod:`lean_store.distributed`: a process group
    was given, or a state, model or optimizer among ``objs`` holds DTensors or ``LocalShard``
    values (an optimizer: DTensor parameters)."""
    if process_group is not None:
        return True
    from .distributed.local_state import holds_shards, is_dtensor

    for obj in objs:
        if obj is None:
            continue
        groups = getattr(obj, "param_groups", None)
        if groups is not None and not isinstance(obj, Mapping):  # an optimizer
            if any(is_dtensor(p) for g in groups for p in g.get("params", ())):
                return True
        elif holds_shards(obj):
            return True
    return False


def write(
    state: Any,
    path: Any,
    *,
    kind: str,
    sharded: bool,
    blocking: bool = True,
    options: SaveOptions,
    backend: str | None = None,
    process_group: Any = None,
    extra_root: dict[str, Any] | None = None,
) -> Layout | SaveHandle:
    """Write ``state`` (a module, state dict or mapping of arrays) on the one path that
    ``sharded`` and ``blocking`` choose; each path honours every option of ``options`` or
    raises a CheckpointError naming the one it cannot."""
    path = checkpoint_path(path)
    if blocking:
        refuse(options, ("snapshot",), "blocking saves", "it sets how blocking=False copies the "
               "state")
    else:  # the path the caller means now, whatever the working directory when it commits
        path = at_call_time(path)
    if sharded:
        from .distributed.sharded_save import FrozenPieces, check_options
        from .distributed.sharded_save import save as sharded_save

        if blocking:  # the collector paused as for loads (.gc_pause); not for a background
            # save, whose pause would hold the training thread's collector off too
            with collection_paused():
                return sharded_save(state, path, process_group=process_group, backend=backend,
                                    options=options, kind=kind, extra_root=extra_root)
        check_options(path, backend, options)  # here, not only at wait()
        frozen = FrozenPieces(state, options.snapshot)
        backend_record(backend_for(path, backend)).import_writer()  # as start() does
        return SaveHandle(path, lambda: sharded_save(
            frozen, path, process_group=process_group, backend=backend, options=options,
            kind=kind, extra_root=extra_root))
    if not blocking:
        return start(state, path, kind=kind, extra_root=extra_root, backend=backend,
                     options=options)
    source = tensor_source(state)
    if len(source.layout) == 0:
        raise CheckpointError("nothing to save: the state has no tensors")
    return write_source(source, path, kind=kind, backend=backend, options=options,
                        extra_root=extra_root)


def kind_of(obj: Any) -> str:
    """``"module"`` for an object with ``state_dict()``, else ``"state"``."""
    return "module" if callable(getattr(obj, "state_dict", None)) else "state"


def save(
    obj: Any,
    path: str | os.PathLike,
    *,
    backend: str | None = None,
    blocking: bool = True,
    process_group: Any = None,
    options: SaveOptions | None = None,
    chunk_bytes: int | None = None,
    compression: Any = None,
    checksum: str | None = None,
    progress: Any = None,
    buffer_bytes: int | None = None,
    snapshot: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """Save a torch module, a state dict, or a mapping of arrays/``Encoded`` to HDF5 or Zarr.

    The checkpoint is written to a hidden temporary sibling and renamed into place only when
    complete, so ``path`` holds either the previous checkpoint or the new one, never a mix.
    Returns the :class:`Layout` written, or with ``blocking=False`` a :class:`SaveHandle` at
    once (the state is snapshot first, see ``snapshot``; ``handle.wait()`` gives the Layout).
    With ``process_group`` (or DTensors / ``LocalShard`` values in the state) every rank
    calls ``save`` and writes only its own shards: see :mod:`lean_store.distributed`.

    The save options (:class:`SaveOptions`) come as ``options=`` or as keywords of the same
    names, not both for one option: ``chunk_bytes``, ``compression``, ``checksum`` (HDF5:
    ``"crc32c"`` default, or ``"fletcher32+crc32c"``), ``progress`` (None: a bar on a terminal
    for big jobs), ``buffer_bytes`` (host staging, default 64 MiB), ``snapshot``
    (``blocking=False`` only) and ``storage_options`` (fsspec options for a URL such as
    ``s3://bucket/run/step.zarr``; else endpoint and credentials come from the environment).
    An option the chosen path cannot honour raises a :class:`CheckpointError` naming it.
    """
    opts = merge_options(options, chunk_bytes=chunk_bytes, compression=compression,
                         checksum=checksum, progress=progress, buffer_bytes=buffer_bytes,
                         snapshot=snapshot, storage_options=storage_options)
    return write(obj, path, kind=kind_of(obj), sharded=is_sharded(process_group, obj),
                 blocking=blocking, options=opts, backend=backend, process_group=process_group)


def save_async(
    obj: Any,
    path: str | os.PathLike,
    *,
    backend: str | None = None,
    process_group: Any = None,
    options: SaveOptions | None = None,
    chunk_bytes: int | None = None,
    compression: Any = None,
    checksum: str | None = None,
    progress: Any = None,
    buffer_bytes: int | None = None,
    snapshot: str | None = None,
) -> SaveHandle:
    """``save(..., blocking=False)``: snapshot ``obj`` and save it in a background thread.

    Bad input (names, formats, backend, a missing directory, a target that is not a lean_store
    checkpoint) raises here, before any thread starts; write errors are raised by
    ``handle.wait()``. A sharded background save runs its collectives in that thread: the
    process group must not be used by other collectives until ``wait()`` returns (give it a
    group of its own, e.g. ``torch.distributed.new_group(backend="gloo")``).
    """
    handle = save(obj, path, backend=backend, blocking=False, process_group=process_group,
                  options=options, chunk_bytes=chunk_bytes, compression=compression,
                  checksum=checksum, progress=progress, buffer_bytes=buffer_bytes,
                  snapshot=snapshot)
    assert isinstance(handle, SaveHandle)
    return handle


def load(
    target: Any,
    path: Any,
    *,
    strict: bool = True,
    cast: Mapping[str, Any] | None = None,
    verify: bool = True,
    progress: Any = None,
    process_group: Any = None,
    strict_order: bool = False,
    storage_options: dict[str, Any] | None = None,
    prefix: str = "",
) -> LoadResult:
    """Load a checkpoint in place into a torch module, a state dict, or a dict of arrays.

    The whole checkpoint is validated first (header, count, names, shapes, formats, widths,
    payload lengths) and, with ``verify=True``, every checksum is checked too. Only then is
    anything copied in; on any error the target is unchanged. There is never a silent cast:
    pass ``cast={"name": "float32"}`` to convert a tensor explicitly.
    Tensors are matched by name, so a file whose tensors are in another order (a converted
    safetensors file is sorted by name) loads; ``strict_order=True`` also requires the file's
    tensors to be in the target's order. A module's meta parameters and buffers (a model
    built under ``torch.device("meta")``) get CPU memory in place, as
    ``load_state_dict(..., assign=True)`` gives them, once the checkpoint is checked.
    ``prefix``: the target's tensor ``name`` is the checkpoint's ``prefix + name``, and the
    checkpoint's tensors without the prefix are not the target's (a module saved inside
    another: a LightningModule's ``model.``, a wrapper's submodule); ``strict`` applies to
    those with it.
    With ``process_group`` (or DTensors / ``LocalShard`` values in the target) every rank
    reads only the regions of its own shards, from a checkpoint saved by any number of ranks;
    ``cast``, a progress bar and ``storage_options`` are refused there (``progress=False``,
    no bar, is honoured).
    """
    if is_sharded(process_group, target):
        refused = [name for name, given in (("cast", cast is not None),
                                             ("progress", progress not in (None, False)),
                                             ("storage_options", storage_options is not None),
                                             ("prefix", bool(prefix)))
                   if given]
        if refused:
            raise CheckpointError(f"{', '.join(refused)} is not supported by sharded loads")
        from .distributed.sharded_load import load as sharded_load

        return sharded_load(target, path, process_group=process_group, strict=strict,
                            verify=verify, strict_order=strict_order)
    return load_single(target, path, strict=strict, cast=cast, verify=verify, progress=progress,
                       strict_order=strict_order, storage_options=storage_options, prefix=prefix)


__all__ = ["is_sharded", "kind_of", "load", "save", "save_async", "write"]
