"""Asynchronous save: snapshot the state now, write it in a background thread.

``snapshot`` chooses how the state is frozen before the call returns, so training may mutate
its parameters right away:

- ``"device"``: a copy next to each tensor (``clone`` on its GPU; for host tensors, in host
  memory). Fast (device memory bandwidth), and host memory stays bounded by ``buffer_bytes``
  while the writer stages the copy chunk by chunk; costs 1x the state in device memory until
  the write ends.
- ``"host"``: device tensors are copied into host memory (1x the state in host RAM), device
  memory is untouched. Use it when the GPU has no room for a second copy.
- ``"auto"`` (default): ``"device"`` when every CUDA device has room for its tensors (with 10 %
  to spare), else ``"host"``.
- ``"none"``: no copy at all; the caller must not modify the state until ``wait()`` returns.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import numpy as np

from .encoded import Encoded
from .errors import CheckpointError
from .layout import Layout

SNAPSHOTS = ("auto", "device", "host", "none")


class SaveHandle:
    """A save running in a background thread. ``wait()`` returns the :class:`Layout` written or
    re-raises the writer's exception; ``done()`` tells whether it has finished."""

    def __init__(self, path: str | os.PathLike, run: Callable[[], Layout]) -> None:
        self.path = Path(path)
        self._future: Future[Layout] = Future()
        # not a daemon: the interpreter waits for a running save rather than dropping it
        self._thread = threading.Thread(
            target=self._run, args=(run,), name=f"lean_store-save-{self.path.name}"
        )
        self._thread.start()

    def _run(self, run: Callable[[], Layout]) -> None:
        try:
            result = run()
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._future.set_exception(exc)
        else:
            self._future.set_result(result)

    def done(self) -> bool:
        """True once the write has finished, successfully or not."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Layout:
        """Block until the checkpoint is committed; re-raise the writer's error if it failed."""
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"save to {self.path} still running after {timeout} s") from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The writer's error, or None; waits like :meth:`wait`."""
        try:
            return self._future.exception(timeout)
        except FutureTimeout:
            raise TimeoutError(f"save to {self.path} still running after {timeout} s") from None

    def __enter__(self) -> SaveHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wait()

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<lean_store.SaveHandle {str(self.path)!r} {state}>"


def snapshot_of(obj: Any, mode: str) -> Any:
    """A frozen copy of the state of ``obj`` (see the module docstring for ``mode``)."""
    if mode not in SNAPSHOTS:
        raise CheckpointError(f"unknown snapshot {mode!r}; use one of {SNAPSHOTS}")
    if mode == "none":
        return obj
    from .sources import _is_torch

    if _is_torch(obj):
        from .sources.torch_source import snapshot_state

        return snapshot_state(obj, mode)
    if not isinstance(obj, Mapping):
        return obj  # tensor_source has already rejected it
    out: dict[str, Any] = {}
    for name, value in obj.items():
        if isinstance(value, Encoded):
            out[name] = Encoded(value.bits.copy(), value.format)
        elif isinstance(value, (np.ndarray, np.generic)):
            out[name] = np.array(value, copy=True)
        else:
            out[name] = value
    return out


def save_async(
    obj: Any,
    path: str | os.PathLike,
    *,
    backend: str | None = None,
    chunk_bytes: int | None = None,
    compression: Any = None,
    progress: Any = None,
    buffer_bytes: int | None = None,
    snapshot: str = "auto",
    checksum: str | None = None,
) -> SaveHandle:
    """Snapshot ``obj`` and save it in a background thread; returns a :class:`SaveHandle`.

    Bad input (names, formats, backend, a missing directory) raises here, before any thread
    starts; write errors are raised by ``handle.wait()``. The target path is replaced
    atomically when the write commits, as with :func:`lean_store.save`.
    """
    from .checkpoint import backend_for, write_source
    from .naming import check_names
    from .sources import tensor_source

    source = tensor_source(obj)  # validates formats and names before copying anything
    if len(source.layout) == 0:
        raise CheckpointError("nothing to save: the state has no tensors")
    check_names(source.layout.names())
    backend = backend_for(path, backend)
    parent = Path(path).parent
    if not parent.is_dir():
        raise CheckpointError(f"cannot save to {path}: directory {parent} does not exist")
    kind = "module" if callable(getattr(obj, "state_dict", None)) else "state"
    frozen = tensor_source(snapshot_of(obj, snapshot))

    def run() -> Layout:
        return write_source(
            frozen, path, kind=kind, backend=backend, chunk_bytes=chunk_bytes,
            compression=compression, progress=progress, buffer_bytes=buffer_bytes,
            checksum=checksum,
        )

    return SaveHandle(path, run)


__all__ = ["SNAPSHOTS", "SaveHandle", "save_async", "snapshot_of"]
