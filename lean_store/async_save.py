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

A save still running when the interpreter exits (the script ends, raises, or calls
``sys.exit``) is finished before the interpreter goes on to shut down, and the exit status stays
the script's own. Why this needs a hook: at exit CPython first runs the functions registered
with ``threading._register_atexit``, in reverse order, and only then joins non-daemon threads.
``concurrent.futures`` registers one there that makes every thread pool refuse new work
("cannot schedule new futures after interpreter shutdown"), and the writer needs pools (its
CRC-32C pool, zarr's I/O executor). A non-daemon thread alone is therefore joined too late: its
pools have been shut down under it. So this module registers, after ``concurrent.futures``, a
hook that waits for every running save; being registered later, it runs first. A save that
failed and was never waited for is reported on stderr at exit, naming its path.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections.abc import Callable

# ThreadPoolExecutor: imported (so concurrent.futures registers its exit hook) before ours
from concurrent.futures import Future, ThreadPoolExecutor  # noqa: F401
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from .errors import CheckpointError
from .fork_safe import ForkSafeLock
from .layout import Layout
from .naming import check_names
from .options import SaveOptions, refuse
from .snapshot import snapshot_of
from .sources import tensor_source
from .stores import commit_order
from .stores.commit import check_parent_directory, is_url
from .stores.registry import backend_for, backend_record
from .stores.target import check_replaceable
from .writing import write_source

_LOCK = ForkSafeLock()
_RUNNING: dict[int, tuple[threading.Thread, Path]] = {}  # saves in progress, by handle number
_UNSEEN_FAILURES: dict[int, str] = {}  # failed saves nobody waited for: their one-line report
_NUMBERS = itertools.count()
_MAX_REASON = 2000  # characters of a failure reported at exit


def _finish_pending_saves() -> None:
    """At interpreter exit, before thread pools are shut down: let every running save finish,
    then report on stderr each failed save whose error nobody has seen."""
    while True:
        with _LOCK:
            running = list(_RUNNING.values())
        if not running:
            break
        for thread, path in running:
            try:
                thread.join()
            except KeyboardInterrupt:
                print(f"lean_store: interrupted while finishing the background save to {path}; "
                      "it is abandoned (a hidden temporary may remain)", file=sys.stderr,
                      flush=True)
                raise
    with _LOCK:
        reports = list(_UNSEEN_FAILURES.values())
        _UNSEEN_FAILURES.clear()
    for report in reports:
        try:
            print(f"lean_store: {report}", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # stderr closed: nothing left to tell
            pass


def _register_exit_hook() -> None:
    register = getattr(threading, "_register_atexit", None)
    if register is not None:  # CPython 3.9+: runs before concurrent.futures' own hook
        register(_finish_pending_saves)
    else:  # pragma: no cover - other interpreters: a running save may then fail, visibly
        import atexit

        atexit.register(_finish_pending_saves)


_register_exit_hook()


def _forget_in_child() -> None:
    """In a forked child: the running saves are the parent's, whose threads the child does not
    have. The parent finishes and reports them; the child's exit does not wait for them (it
    waited forever: a ``multiprocessing`` or DataLoader worker forked during a background save
    never exited)."""
    _RUNNING.clear()
    _UNSEEN_FAILURES.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class SaveHandle:
    """A save running in a background thread. ``wait()`` returns the :class:`Layout` written or
    re-raises the writer's exception; ``done()`` tells whether it has finished. A save still
    running at interpreter exit is finished first (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, run: Callable[[], Layout]) -> None:
        self.path = Path(path)
        self._pid = os.getpid()
        self._future: Future[Layout] = Future()
        self._number = next(_NUMBERS)
        # its place among the saves to the path, taken now: of two saves to one path, the
        # one called last is what the path holds (stores/commit_order.py)
        turn = None if is_url(path) else commit_order.reserve(path)
        # not a daemon, and waited for by the exit hook before thread pools stop
        self._thread = threading.Thread(
            target=self._run, args=(run, turn), name=f"lean_store-save-{self.path.name}"
        )
        with _LOCK:
            _RUNNING[self._number] = (self._thread, self.path)
        try:
            self._thread.start()
        except BaseException:
            with _LOCK:
                del _RUNNING[self._number]
            if turn is not None:
                turn.release()
            raise

    def _run(self, run: Callable[[], Layout], turn: commit_order.Turn | None) -> None:
        try:
            with commit_order.reserved(turn):
                result = run()
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            reason = f"{type(exc).__name__}: {exc}"
            if len(reason) > _MAX_REASON:
                reason = reason[:_MAX_REASON] + " ..."
            with _LOCK:
                _UNSEEN_FAILURES[self._number] = (
                    f"the background save to {self.path} failed and was never waited for: "
                    f"{reason}"
                )
            self._future.set_exception(exc)
        else:
            self._future.set_result(result)
        finally:
            with _LOCK:
                _RUNNING.pop(self._number, None)

    def _seen(self) -> None:
        with _LOCK:
            _UNSEEN_FAILURES.pop(self._number, None)

    def done(self) -> bool:
        """True once the write has finished, successfully or not."""
        return self._future.done()

    def _check_process(self) -> None:
        if os.getpid() != self._pid and not self._future.done():
            raise CheckpointError(
                f"the background save to {self.path} runs in process {self._pid}; this process "
                "is a child forked while it ran and cannot wait for it (the parent finishes it)")

    def wait(self, timeout: float | None = None) -> Layout:
        """Block until the checkpoint is committed; re-raise the writer's error if it failed.
        CheckpointError in a child forked while the save ran (it runs in the parent)."""
        self._check_process()
        try:
            result = self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"save to {self.path} still running after {timeout} s") from None
        except BaseException:
            self._seen()
            raise
        return result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The writer's error, or None; waits like :meth:`wait`."""
        self._check_process()
        try:
            exc = self._future.exception(timeout)
        except FutureTimeout:
            raise TimeoutError(f"save to {self.path} still running after {timeout} s") from None
        self._seen()
        return exc

    def __enter__(self) -> SaveHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wait()

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<lean_store.SaveHandle {str(self.path)!r} {state}>"


def start(
    obj: Any,
    path: str | os.PathLike,
    *,
    kind: str,
    extra_root: dict[str, Any] | None = None,
    backend: str | None = None,
    options: SaveOptions,
    around: Callable[[Callable[[], Layout]], Layout] | None = None,
) -> SaveHandle:
    """Snapshot ``obj`` (``options.snapshot``) and save it in a background thread; returns a
    :class:`SaveHandle`. The API layer (:func:`lean_store.save` with ``blocking=False``) calls it.
    ``around``: runs the write in the background thread (``around(write)``) and what it does
    after it is part of the save (a Checkpointer's pruning).

    Bad input (names, formats, backend, a missing directory, a target that is not a lean_store
    checkpoint) raises here, before any thread starts; write errors are raised by
    ``handle.wait()``. The target path is replaced atomically when the write commits, as with
    a blocking save.
    """
    refuse(options, ("storage_options",), "background (blocking=False) saves",
           "set the AWS environment variables instead")
    source = tensor_source(obj)  # validates formats and names before copying anything
    if len(source.layout) == 0:
        raise CheckpointError("nothing to save: the state has no tensors")
    check_names(source.layout.names())
    backend = backend_for(path, backend)
    check_parent_directory(path)
    # a foreign path: refused here
    check_replaceable(path, directory=backend_record(backend).directory)
    frozen = tensor_source(snapshot_of(obj, options.snapshot))
    backend_record(backend).import_writer()  # here, not under the save thread's import locks

    def run() -> Layout:
        return write_source(frozen, path, kind=kind, backend=backend, options=options,
                            extra_root=extra_root)

    return SaveHandle(path, run if around is None else lambda: around(run))


__all__ = ["SaveHandle", "start"]
