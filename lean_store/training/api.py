"""The training verbs: ``save_training``, ``save_optimizer``, ``load_training`` and
``load_optimizer``. Each builds or checks the training state (:mod:`.state`) and lets the API
layer (:mod:`lean_store.api`) decide, once, whether the call is sharded and whether it blocks;
the sharded parts are :mod:`lean_store.distributed.training`. See docs/TRAINING.md.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Collection, Mapping
from typing import Any

from ..api import is_sharded, write
from ..async_save import SaveHandle
from ..errors import CheckpointError
from ..layout import Layout
from ..options import SaveOptions, merge_options
from .state import (
    SCHEDULED,
    TrainingInfo,
    build_training_state,
    load_single,
    single_training_state,
    training_root,
)


def save_optimizer(
    optimizer: Any,
    path: str | os.PathLike,
    *,
    rng: bool = True,
    model: Any = None,
    generators: Mapping[str, Any] | None = None,
    backend: str | None = None,
    process_group: Any = None,
    blocking: bool = True,
    options: SaveOptions | None = None,
    chunk_bytes: int | None = None,
    compression: Any = None,
    checksum: str | None = None,
    progress: Any = None,
    buffer_bytes: int | None = None,
    snapshot: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Layout | SaveHandle:
    """Save an optimizer's state (moments, steps, hyperparameters, parameter names) and, with
    ``rng=True``, the global RNG states. Parameter names come from ``model`` when given, else
    from the optimizer's ``param_names``, else positions. An optimizer with no state yet
    raises :class:`CheckpointError`. With ``process_group`` (or DTensor parameters) every
    rank calls it and writes its own shards (see docs/SHARDING.md). Save options as for
    :func:`lean_store.save`: ``options=SaveOptions(...)`` or the keywords ``chunk_bytes``,
    ``compression``, ``checksum``, ``progress``, ``buffer_bytes``, ``snapshot``,
    ``storage_options``; ``blocking=False`` returns a :class:`SaveHandle`."""
    opts = merge_options(options, chunk_bytes=chunk_bytes, compression=compression,
                         checksum=checksum, progress=progress, buffer_bytes=buffer_bytes,
                         snapshot=snapshot, storage_options=storage_options)
    return _save(path, "optimizer", dict(model=None, names_model=model, optimizer=optimizer,
                                         rng=rng, generators=generators),
                 backend=backend, process_group=process_group, blocking=blocking,
                 options=opts)


def step_number(step: Any) -> int | None:
    """``step`` as a Python int: an int, a numpy integer or an integer 0-d tensor (anything
    with ``__index__``: a step counter kept in numpy or torch); None for anything else (a bool,
    a float, a string)."""
    if isinstance(step, bool) or "bool" in str(getattr(step, "dtype", "")):
        return None
    try:
        return operator.index(step)
    except TypeError:
        return None


def save_training(
    path: str | os.PathLike,
    *,
    model: Any,
    optimizer: Any = None,
    scheduler: Any = None,
    step: int | None = None,
    rng: bool = True,
    data: Any = None,
    extra: Any = None,
    generators: Mapping[str, Any] | None = None,
    backend: str | None = None,
    process_group: Any = None,
    blocking: bool = True,
    options: SaveOptions | None = None,
    chunk_bytes: int | None = None,
    compression: Any = None,
    checksum: str | None = None,
    progress: Any = None,
    buffer_bytes: int | None = None,
    snapshot: str | None = None,
    storage_options: dict[str, Any] | None = None,
    scaler: Any = None,
) -> Layout | SaveHandle:
    """Save one complete training checkpoint, committed atomically.

    ``data`` is the data position: a ``torch.Generator``, a ``numpy.random.Generator``, any
    object with ``state_dict()``/``load_state_dict()``, or a mapping (e.g. epoch and index).
    ``extra`` is any JSON-like tree. ``generators`` names further RNG objects to capture.
    ``scaler`` is a mixed-precision loss scaler (``torch.amp.GradScaler``): its scale and
    growth tracker, without which a resumed fp16 run starts from the initial scale again.
    With ``process_group`` (or a DTensor model) every rank calls it: each writes its own
    shards of parameters and moments and its own RNG states; rank 0 writes the metadata.
    Save options as for :func:`lean_store.save` (``options=`` or keywords); ``blocking=False``
    captures everything now and returns a :class:`SaveHandle`.
    """
    if step is not None:
        number = step_number(step)
        if number is None or number < 0:
            raise CheckpointError(f"step must be a non-negative int or None, got {step!r}")
        step = number
    opts = merge_options(options, chunk_bytes=chunk_bytes, compression=compression,
                         checksum=checksum, progress=progress, buffer_bytes=buffer_bytes,
                         snapshot=snapshot, storage_options=storage_options)
    return _save(path, "training", dict(model=model, names_model=model, optimizer=optimizer,
                                        scheduler=scheduler, step=step, rng=rng, data=data,
                                        extra=extra, generators=generators, scaler=scaler),
                 backend=backend, process_group=process_group, blocking=blocking,
                 options=opts)


def _check_parts(how: dict[str, Any]) -> None:
    """CheckpointError naming an optimizer, scheduler, scaler or ``generators`` of the wrong kind
    (an optimizer passed as the model, a number), before anything is read or written."""
    optimizer = how.get("optimizer")
    if optimizer is not None and not (
        isinstance(getattr(optimizer, "param_groups", None), list)
        and callable(getattr(optimizer, "state_dict", None))
        and callable(getattr(optimizer, "load_state_dict", None))
    ):
        raise CheckpointError(f"optimizer must be a torch optimizer (param_groups, state_dict, "
                              f"load_state_dict), got {type(optimizer).__name__}")
    for field in ("scheduler", "scaler"):
        part = how.get(field)
        if part is not None and not (callable(getattr(part, "state_dict", None))
                                     and callable(getattr(part, "load_state_dict", None))):
            raise CheckpointError(f"{field} must have state_dict() and load_state_dict(), got "
                                  f"{type(part).__name__}")
    generators = how.get("generators")
    if generators is not None and not isinstance(generators, Mapping):
        raise CheckpointError(f"generators must map names to RNG objects, got "
                              f"{type(generators).__name__}")


def captured_training(**build: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A single process's training state as :func:`save_training` takes it, captured now
    (the tensors by reference, the RNG states and plain data copied): ``(tensors,
    root attributes)`` for :func:`lean_store.async_save.start` (a Checkpointer's background
    save). The keywords are :func:`save_training`'s parts (``model``, ``optimizer``, ...)."""
    build = dict(names_model=build.get("model"), **build)
    _check_parts(build)
    return single_training_state(**build)


def _save(path: Any, kind: str, build: dict[str, Any], *, backend: str | None,
          process_group: Any, blocking: bool, options: SaveOptions) -> Layout | SaveHandle:
    _check_parts(build)
    sharded = is_sharded(process_group, build["model"], build["names_model"],
                             build["optimizer"])
    if sharded:
        from ..distributed.training import gather_training_state

        tensors, text = gather_training_state(lambda: build_training_state(**build),
                                              process_group=process_group)
        extra_root = training_root(text)
    else:
        tensors, extra_root = single_training_state(**build)
    return write(tensors, path, kind=kind, sharded=sharded, blocking=blocking, options=options,
                 backend=backend, process_group=process_group, extra_root=extra_root)


def load_optimizer(
    optimizer: Any,
    path: Any,
    *,
    model: Any = None,
    rng: bool = True,
    generators: Mapping[str, Any] | None = None,
    scheduled: Collection[str] = SCHEDULED,
    process_group: Any = None,
) -> TrainingInfo:
    """Restore an optimizer (and, with ``rng=True``, the RNG states) from a file written by
    :func:`save_optimizer` or :func:`save_training`. Everything is validated first; on any
    mismatch a :class:`CheckpointError` is raised and nothing is changed. Group keys named in
    ``scheduled`` (the learning rate) are restored rather than compared."""
    return _load(path, model=None, names_model=model, optimizer=optimizer, rng=rng,
                 generators=generators, scheduled=scheduled, process_group=process_group)


def load_training(
    path: Any,
    *,
    model: Any,
    optimizer: Any = None,
    scheduler: Any = None,
    data: Any = None,
    rng: bool = True,
    generators: Mapping[str, Any] | None = None,
    scheduled: Collection[str] = SCHEDULED,
    process_group: Any = None,
    scaler: Any = None,
) -> TrainingInfo:
    """Restore a training checkpoint in place: model, optimizer, scheduler, loss scaler, data
    position and RNG states, all validated before any is changed. Returns a
    :class:`TrainingInfo`.
    With ``process_group`` (or a DTensor model) every rank calls it and reads only its own
    regions, from a checkpoint saved by any number of ranks; all ranks validate and agree
    before any installs. Each rank gets its own RNG states back when the world size is the
    one that saved; otherwise RNG is skipped with a warning."""
    return _load(path, model=model, names_model=model, optimizer=optimizer,
                 scheduler=scheduler, data=data, rng=rng, generators=generators,
                 scheduled=scheduled, process_group=process_group, scaler=scaler)


def training_info(path: Any) -> TrainingInfo:
    """What a training checkpoint says besides its tensors (its step, ``extra``, data
    position, format), read without changing anything: no model, optimizer or global RNG
    state is touched and no tensor is read (``load_training(path, model=None)`` restores the
    global RNG states, ``rng=True`` being its default). For choosing a step by a metric kept
    in ``extra``; a sharded checkpoint is read by one process."""
    return load_single(path, stacklevel=3, model=None, names_model=None, optimizer=None,
                       scheduler=None, data=None, rng=False, generators=None,
                       scheduled=SCHEDULED, scaler=None)


def _load(path: Any, *, process_group: Any, **how: Any) -> TrainingInfo:
    stacklevel = 4  # the warning points at the caller of load_training / load_optimizer
    _check_parts(how)
    if is_sharded(process_group, how["model"], how["names_model"], how["optimizer"]):
        from ..distributed.training import load_training as sharded_load

        return sharded_load(path, process_group=process_group,
                            stacklevel=stacklevel, **how)
    return load_single(path, stacklevel=stacklevel, **how)


__all__ = ["load_optimizer", "load_training", "save_optimizer", "save_training",
           "training_info"]
