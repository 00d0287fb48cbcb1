"""``Checkpointer``: the checkpoints of one training run, one per step, keeping the last N.

Each step is one training checkpoint named ``step_<n>.h5`` or ``step_<n>.zarr`` in the run's
directory. It is written by the stores' atomic commit: the data goes to a hidden temporary
sibling (``.step_<n>.h5.lean_store-tmp-*``) that is fsynced and renamed into place only when
complete, so a step is either listed and whole, or not listed at all. A writer killed mid-save
leaves only a hidden temporary, which :meth:`Checkpointer.save` clears away next time.

With ``incremental=True`` (Zarr only) a step hard-links every chunk or shard file that is
byte-identical to the previous step's instead of writing it (see
:mod:`~lean_store.stores.zarr.incremental`): each step is still a complete, standalone store,
and deleting any step never damages another.

Steps dropped by ``keep_last`` (or replaced with ``overwrite=True``) leave the listing before
``save`` returns: each is renamed to a hidden ``.step_<n>.*.lean_store-dead-*`` name at once,
and its files are removed by a background thread (at most :data:`MAX_DELETING` such steps at a
time; :meth:`Checkpointer.finish_deletions` waits for them, and so does the interpreter's exit).
A process killed meanwhile leaves a hidden leftover that the next ``save`` clears away.

One directory belongs to one writer at a time. With ``process_group`` (or a DTensor model) the
writer is the group: every rank calls ``save``/``restore``, each step is a sharded training
checkpoint, and rank 0 alone lists, cleans and prunes the directory, with the ranks agreeing
before and after.
"""

from __future__ import annotations

import os
import re
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from ..async_save import SaveHandle, start
from ..distributed.collective import on_rank0
from ..errors import CheckpointError, ForeignPathError, IntegrityError, SaveIOError
from ..options import SaveOptions, merge_options
from ..stores.commit import at_call_time, remove_path
from ..stores.leftovers import writer_gone
from ..stores.registry import BACKENDS, backend_record, checkpoint_path
from ..stores.target import check_replaceable
from ..stores.zarr.incremental import Described, IncrementalStats, linking_from
from .api import captured_training, load_training, save_training, step_number, training_info
from .best_steps import BestSteps
from .state import SCHEDULED, TrainingInfo

_SUFFIX = {"hdf5": ".h5", "zarr": ".zarr"}
_STEP = re.compile(r"^step_(\d{1,19})\.(h5|zarr)$")
_LEFTOVER = re.compile(r"^\.step_\d{1,19}\.(h5|zarr)\.lean_store-(tmp|old|dead)-[0-9a-f]+$")
T = TypeVar("T")
MAX_DELETING = 2
"""Dropped steps whose files may be being removed in the background at once (bounds the disk
space a fast run of saves can hold in removed steps)."""


STALE_SECONDS = 24 * 3600
"""A save's temporary whose writer cannot be judged (another host, an older naming) is removed
by :meth:`Checkpointer.clean_incomplete` once nothing in it changed for this long."""


def _untouched_for(path: Path, seconds: float) -> bool:
    """True when neither ``path`` nor an entry directly inside it changed for ``seconds``."""
    try:
        newest = path.lstat().st_mtime
        if path.is_dir() and not path.is_symlink():
            with os.scandir(path) as entries:
                for entry in entries:
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    except OSError:
        return False  # changing under us (or gone): not stale
    return time.time() - newest > seconds


class Checkpointer:
    """Manage step checkpoints in ``directory``.

    >>> ck = Checkpointer("run/", keep_last=3)
    >>> ck.save(100, model=model, optimizer=opt, scheduler=sched, data=loader_state)
    >>> info = ck.restore(model=model, optimizer=opt, scheduler=sched, data=loader_state)
    """

    def __init__(self, directory: str | os.PathLike, *, keep_last: int | None = None,
                 keep_every: int | None = None, keep_best: int | None = None,
                 metric: str | Callable[[TrainingInfo], float] | None = None,
                 mode: str = "min", backend: str = "hdf5", create: bool = True,
                 process_group: Any = None, incremental: bool = False,
                 options: SaveOptions | None = None,
                 chunk_bytes: int | None = None, compression: Any = None,
                 checksum: str | None = None, progress: Any = None,
                 buffer_bytes: int | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        """``options`` (or the :class:`SaveOptions` keywords, e.g. ``compression=``) apply to
        every step; one ``save`` may override a field with its keyword, or all with its own
        ``options``; ``snapshot`` is a background save's (``save(..., blocking=False)``).

        Pruning keeps the last ``keep_last`` steps (None: every step), the multiples of
        ``keep_every`` and the ``keep_best`` best steps by ``metric`` (a key of the steps'
        ``extra``, or a function of a step's :class:`TrainingInfo`; ``mode`` ``"min"`` or
        ``"max"``): a step is kept when any of them keeps it. ``keep_best`` without
        ``keep_last`` keeps the latest step too (a run resumes from it)."""
        if backend not in BACKENDS:
            raise CheckpointError(f"unknown backend {backend!r}; use one of {BACKENDS}")
        if incremental and not backend_record(backend).incremental:
            raise CheckpointError(
                "incremental=True needs backend='zarr': unchanged chunks are shared between "
                "steps as hard-linked chunk files, and an HDF5 checkpoint is one file (sharing "
                "chunks would need external or virtual storage, which lean_store refuses)"
            )
        if incremental and process_group is not None:
            raise CheckpointError("incremental=True is not supported for sharded (process_group)"
                                  " runs yet")
        for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise CheckpointError(f"{name} must be a positive int or None, got {value!r}")
        self.options = merge_options(
            options, chunk_bytes=chunk_bytes, compression=compression, checksum=checksum,
            progress=progress, buffer_bytes=buffer_bytes, storage_options=storage_options)
        if self.options.snapshot != SaveOptions().snapshot:
            raise CheckpointError("save option snapshot is not a Checkpointer's: pass it to a "
                                  "save with blocking=False (a blocking save copies nothing)")
        # anchored now: a later chdir moves no step
        self.directory = Path(at_call_time(checkpoint_path(directory)))
        if keep_best is None and (metric is not None or mode != "min"):
            raise CheckpointError("metric= and mode= rank the steps for keep_best=N, which "
                                  "was not given")
        self._best = None if keep_best is None else BestSteps(keep_best, metric, mode)
        if keep_best is not None and keep_last is None:
            keep_last = 1  # the step a run resumes from, whatever its metric
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.backend = backend
        self.process_group = process_group
        self.incremental = bool(incremental)
        self._deleter: ThreadPoolExecutor | None = None  # removes dropped steps' files
        self._deleting: dict[str, Future[None]] = {}  # hidden name -> its removal
        self.last_save_stats: IncrementalStats | None = None
        """Written and linked unit-file bytes of the last save, when it had a step to link to."""
        self._described: Described | None = None  # the last incremental save's arrays
        self._pending: SaveHandle | None = None  # the background save running, if any
        if create:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError):
                raise CheckpointError(
                    f"cannot use {self.directory} as a Checkpointer's directory: it, or a "
                    "folder above it, is a file (a Checkpointer writes its steps into a "
                    "directory; to save one checkpoint to a file, use lean_store.save or "
                    "save_training)") from None
            except OSError as exc:
                raise SaveIOError.wrapping(self.directory, exc) from None
        elif not self.directory.is_dir():
            raise CheckpointError(f"no checkpoint directory at {self.directory}")

    # ------------------------------------------------------------------------- listing

    def _entries(self) -> dict[int, Path]:
        found: dict[int, Path] = {}
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return found
        for name in names:
            match = _STEP.match(name)
            if match:
                step = int(match.group(1))
                if step not in found or match.group(2) == _SUFFIX[self.backend][1:]:
                    found[step] = self.directory / name
        return found

    def steps(self) -> list[int]:
        """Every committed step, ascending. Temporaries of unfinished saves are never listed."""
        return sorted(self._entries())

    def latest(self) -> int | None:
        """The highest committed step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> Path:
        """Where ``step`` is (or would be) stored."""
        step = _check_step(step)
        existing = self._entries().get(step)
        return existing or self.directory / f"step_{step:010d}{_SUFFIX[self.backend]}"

    # -------------------------------------------------------------------------- saving

    def save(self, step: int, *, model: Any, optimizer: Any = None, scheduler: Any = None,
             rng: bool = True, data: Any = None, extra: Any = None,
             generators: Mapping[str, Any] | None = None, overwrite: bool = False,
             blocking: bool = True, snapshot: str | None = None,
             options: SaveOptions | None = None, chunk_bytes: int | None = None,
             compression: Any = None, checksum: str | None = None, progress: Any = None,
             buffer_bytes: int | None = None,
             storage_options: dict[str, Any] | None = None,
             scaler: Any = None) -> Path | SaveHandle:
        """Write ``step`` atomically, then drop the oldest steps beyond ``keep_last``; returns
        the step's path. Save options: the Checkpointer's, with this call's keywords
        (``compression=``, ``chunk_bytes=``, ...) overriding them, or this call's ``options``
        instead.

        ``blocking=False``: everything is captured now (tensors copied as ``snapshot`` says,
        as for :func:`lean_store.save`), and the step is written and the old steps dropped in
        the background; returns a :class:`~lean_store.SaveHandle` (``.path`` is the step's).
        One background save runs at a time: the next ``save``, ``restore``,
        ``discard_after`` or :meth:`wait` waits for it first, and raises its error if it
        failed. Until it commits, ``steps()`` and ``latest()`` do not list it."""
        self.wait()
        opts = merge_options(options, self.options, chunk_bytes=chunk_bytes,
                             compression=compression, checksum=checksum, progress=progress,
                             buffer_bytes=buffer_bytes, snapshot=snapshot,
                             storage_options=storage_options)
        comm = self._comm(model, optimizer)
        if comm is not None:
            if not blocking:
                raise CheckpointError("blocking=False is not supported by a sharded "
                                      "Checkpointer (process_group) yet: save with blocking=True")
            return self._save_sharded(comm, step, model=model, optimizer=optimizer,
                                      scheduler=scheduler, rng=rng, data=data, extra=extra,
                                      generators=generators, overwrite=overwrite,
                                      options=opts, scaler=scaler)
        step = _check_step(step)
        parts = dict(model=model, optimizer=optimizer, scheduler=scheduler, step=step, rng=rng,
                     data=data, extra=extra, generators=generators, scaler=scaler)
        if not blocking:
            tensors, extra_root = captured_training(**parts)  # before any refusal below
        path, existing = self._place(step, overwrite)
        if blocking:
            self._commit_step(path, existing, lambda: save_training(
                path, backend=self.backend, options=opts, **parts))
            return path
        self._pending = start(tensors, path, kind="training", extra_root=extra_root,
                              backend=self.backend, options=opts,
                              around=lambda write: self._commit_step(path, existing, write))
        return self._pending

    def wait(self, timeout: float | None = None) -> Path | None:
        """Wait for the background save (``save(..., blocking=False)``) still running, if
        any, and its pruning; re-raise its error if it failed. Returns its step's path (None
        when there was none)."""
        pending = self._pending
        if pending is None:
            return None
        try:
            pending.wait(timeout)
        except TimeoutError:
            raise
        except BaseException as exc:
            self._pending = None
            exc.add_note(f"(the background save of {pending.path.name} in {self.directory})")
            raise
        self._pending = None
        return pending.path

    def _commit_step(self, path: Path, existing: Path | None, write: Callable[[], T]) -> T:
        """``write()`` (the step's save to ``path``), linking to the previous step when
        incremental; then the checkpoint it replaced and the steps beyond ``keep_last`` are
        dropped."""
        if self.incremental:
            base = self._base()
            self._described, described = None, self._described
            with linking_from(base, described) as linking:
                written = write()
            # the next step links to this one: its arrays as written, no document reread
            self._described = linking.described(path)
            self.last_save_stats = linking.stats if base is not None else None
        else:
            written = write()
            self.last_save_stats = None
        if existing is not None and existing != path:
            self._remove(existing)
        self._prune(keep=path)
        return written

    def _place(self, step: int, overwrite: bool) -> tuple[Path, Path | None]:
        """Where ``step`` goes and the committed checkpoint it replaces (None for a new step),
        after the leftovers of interrupted saves are cleaned and every refusal is made."""
        self.clean_incomplete()
        entries = self._entries()
        existing = entries.get(step)
        if existing is not None and not overwrite:
            raise CheckpointError(f"step {step} already exists at {existing}; pass overwrite=True")
        path = self.directory / f"step_{step:010d}{_SUFFIX[self.backend]}"
        if existing is not None and existing != path:
            check_replaceable(existing)  # it is removed after the save: refuse before it
        self._warn_later(step, entries)
        return path, existing

    def _warn_later(self, step: int, entries: Mapping[int, Path]) -> None:
        """Warn when later steps than ``step`` are committed: they are what ``latest()`` and
        ``restore()`` pick, and what ``keep_last`` keeps."""
        later = sorted(s for s in entries if s > step)
        if later:
            shown = ", ".join(map(str, later[:5])) + (" ..." if len(later) > 5 else "")
            warnings.warn(
                f"saving step {step} into {self.directory}, which holds later steps ({shown}): "
                f"latest() and restore() still pick step {later[-1]}, and keep_last counts them "
                "and prunes the earlier ones. If this run goes on from an earlier step (rewound "
                f"after a divergence, or restored from a damaged latest step), remove them "
                f"first with discard_after({step})", stacklevel=3)

    def discard_after(self, step: int) -> list[int]:
        """Remove every committed step after ``step`` (a rewound run's abandoned steps), as
        pruning removes a step (renamed aside at once, deleted in the background); returns
        the steps removed. In a sharded run, call it on one process."""
        step = _check_step(step)
        self.wait()
        removed = []
        for later, path in sorted(self._entries().items()):
            if later > step:
                try:
                    self._remove(path)
                except FileNotFoundError:
                    continue  # removed meanwhile
                removed.append(later)
        return removed

    def _base(self) -> Path | None:
        """The step an incremental save links to: the latest committed Zarr step."""
        entries = self._entries()
        for step in sorted(entries, reverse=True):
            if entries[step].suffix == ".zarr" and entries[step].is_dir():
                return entries[step]
        return None

    def _comm(self, model: Any, optimizer: Any) -> Any:
        """The collective of a sharded run, or None for a single process."""
        from ..api import is_sharded

        if not is_sharded(self.process_group, model, optimizer):
            return None
        from ..distributed.collective import Collective

        return Collective(self.process_group)

    def _save_sharded(self, comm: Any, step: int, *, model: Any, overwrite: bool,
                      **kwargs: Any) -> Path:
        step = _check_step(step)

        def check() -> list[str | None]:
            path, existing = self._place(step, overwrite)
            return [str(path), None if existing is None else str(existing)]

        path, existing = on_rank0(comm, check)
        save_training(path, model=model, step=step, backend=self.backend,
                      process_group=self.process_group, **kwargs)

        def prune() -> None:
            if existing is not None and existing != path:
                self._remove(Path(existing))
            self._prune(keep=Path(path))

        on_rank0(comm, prune)
        return Path(path)

    def _prune(self, keep: Path) -> None:
        """Drop the lowest steps beyond ``keep_last``, never ``keep`` (the step just saved:
        with later steps in the directory it may be the lowest), a multiple of ``keep_every``
        (a milestone) nor one of the ``keep_best`` best: those are kept as well as the last
        steps, not instead of them."""
        if self.keep_last is None:
            return
        entries = self._entries()
        excess = len(entries) - self.keep_last
        best = set() if self._best is None or excess <= 0 else self._best.of(entries,
                                                                             training_info)
        for step in sorted(entries):
            if excess <= 0:
                break
            if entries[step] == keep:
                continue
            excess -= 1
            if step in best or (self.keep_every is not None and step % self.keep_every == 0):
                continue  # one of the best, or a milestone: beyond keep_last, and kept
            try:
                self._remove(entries[step])
            except FileNotFoundError:
                continue  # pruned meanwhile by another process saving into this directory
            except ForeignPathError as exc:  # the save itself succeeded: keep it, and say so
                if os.path.lexists(entries[step]):  # (else pruned while it was looked at)
                    warnings.warn(f"not pruning step {step}: {exc}", stacklevel=3)

    def _remove(self, path: Path) -> None:
        """Delete a step, only if it holds a lean_store checkpoint (else ForeignPathError)."""
        check_replaceable(path)
        # rename aside first: a crash mid-delete never leaves a half-deleted visible step
        dead = path.with_name(f".{path.name}.lean_store-dead-{uuid.uuid4().hex}")
        os.rename(path, dead)
        self._remove_later(dead)

    def _remove_later(self, dead: Path) -> None:
        """Remove the renamed-aside step ``dead`` on the background thread, after waiting
        for the oldest removals beyond :data:`MAX_DELETING`."""
        self._deleting = {n: f for n, f in self._deleting.items() if not f.done()}
        while len(self._deleting) >= MAX_DELETING:
            self._deleting.pop(next(iter(self._deleting))).result()
        if self._deleter is None:
            self._deleter = ThreadPoolExecutor(1, thread_name_prefix="lean_store-prune")
        try:
            self._deleting[dead.name] = self._deleter.submit(remove_path, dead)
        except RuntimeError:  # the interpreter is shutting down: no new threads
            remove_path(dead)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, pickling for a spawned process) uses the same directory
        and settings; the removals of pruned steps still running belong to this object (their
        thread cannot be copied): the copy starts with none."""
        state = dict(self.__dict__)
        state["_deleter"] = None
        state["_deleting"] = {}
        state["_pending"] = None
        return state

    def finish_deletions(self) -> None:
        """Wait until the files of every step this Checkpointer dropped are removed (after
        a background save still running, whose pruning may drop more)."""
        self.wait()
        for future in list(self._deleting.values()):
            future.result()
        self._deleting.clear()

    def clean_incomplete(self) -> list[Path]:
        """Remove temporaries left by interrupted saves and deletions; return what went.

        Kept: a save's temporary whose writer may still run (another process saving into
        the same directory, a job restarted while the old one is still alive: removing it
        would fail that save, or commit a tree with files missing); one whose writer cannot
        be judged from here (another host, an older lean_store's naming) until it has been
        left untouched for :data:`STALE_SECONDS`; and the previous checkpoint of a step
        renamed aside by an overwrite whose new checkpoint was never committed (its only
        copy, to be renamed back by hand)."""
        removed: list[Path] = []
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return removed
        for name in names:
            busy = self._deleting.get(name)
            if busy is not None and not busy.done():
                continue  # being removed by this Checkpointer's background thread
            path = self.directory / name
            found = _LEFTOVER.match(name)
            # gone since the listing (the background thread finished it): not ours to report
            if found is None or not os.path.lexists(path):
                continue
            if found.group(2) == "tmp":
                gone = writer_gone(path)
                if gone is False or (gone is None and not _untouched_for(path, STALE_SECONDS)):
                    continue
            if found.group(2) == "old" and not os.path.lexists(
                    self.directory / name[1:name.index(".lean_store-old-")]):
                continue
            remove_path(path)
            removed.append(path)
        return removed

    # ------------------------------------------------------------------------- restoring

    def restore(self, step: int | None = None, *, model: Any, optimizer: Any = None,
                scheduler: Any = None, data: Any = None, rng: bool = True,
                generators: Mapping[str, Any] | None = None,
                scheduled: Any = SCHEDULED, scaler: Any = None) -> TrainingInfo:
        """Restore ``step`` (default: the latest) in place; see :func:`load_training`. A
        background save still running is waited for first (its error raised)."""
        self.wait()
        comm = self._comm(model, optimizer)
        if comm is not None:  # rank 0 chooses the step, so every rank loads the same one
            path = on_rank0(comm, lambda: str(self._find(step)))
            return load_training(path, model=model, optimizer=optimizer, scheduler=scheduler,
                                 data=data, rng=rng, generators=generators,
                                 scheduled=scheduled, process_group=self.process_group,
                                 scaler=scaler)

        def restore_at(path: Path) -> TrainingInfo:
            try:
                return load_training(path, model=model, optimizer=optimizer,
                                     scheduler=scheduler, data=data, rng=rng,
                                     generators=generators, scheduled=scheduled, scaler=scaler)
            except IntegrityError as exc:
                older = self.steps()[:-1]  # the latest was restored: the steps before it
                if step is not None or not older or not os.path.lexists(path):
                    raise
                raise type(exc)(
                    f"{exc}\nThe latest step ({path.name}) cannot be restored; nothing was "
                    f"changed. Older steps: {older[-5:]}. Check one with lean_store.verify, "
                    f"restore it with restore(step={older[-1]}, ...), then remove the damaged "
                    f"step with discard_after({older[-1]}) (or move it away) before saving the "
                    "following steps") from exc

        return self._read_step(step, restore_at)

    def info(self, step: int | None = None) -> TrainingInfo:
        """What ``step`` (default: the latest) says besides its tensors (its ``extra``, data
        position, ...), read without changing anything (:func:`training_info`): to choose a
        step by a metric kept in ``extra``."""
        self.wait()
        return self._read_step(step, training_info)

    def _read_step(self, step: int | None, read: Callable[[Path], T]) -> T:
        """``read`` of ``step``'s path; without ``step``, of the latest, read again as the
        latest then when the one read was pruned meanwhile (:data:`LATEST_ATTEMPTS`)."""
        for attempt in range(LATEST_ATTEMPTS):
            path = self._find(step)
            try:
                return read(path)
            except CheckpointError:
                if step is None and attempt + 1 < LATEST_ATTEMPTS and not os.path.lexists(path):
                    continue  # pruned while it was read (another process saves on)
                raise
        raise AssertionError("unreachable: the last attempt raises")  # pragma: no cover

    def _find(self, step: int | None) -> Path:
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointError(f"no committed checkpoint in {self.directory}")
        step = _check_step(step)
        path = self._entries().get(step)
        if path is None:
            raise CheckpointError(f"no committed checkpoint for step {step} in {self.directory}; "
                                  f"steps: {self.steps()}")
        return path

    def __repr__(self) -> str:
        return (f"Checkpointer({str(self.directory)!r}, keep_last={self.keep_last}, "
                f"keep_every={self.keep_every}, "
                f"keep_best={None if self._best is None else self._best.keep}, "
                f"backend={self.backend!r}, incremental={self.incremental}, steps={self.steps()})")


LATEST_ATTEMPTS = 3
"""Reads of "the latest step" (``restore``, ``info`` without ``step``) from a directory
another process saves into (an evaluation job beside a training job): a step pruned by the
saver's ``keep_last`` between the listing and the read is gone, and the latest step is read
instead, at most this many times. Nothing is installed from a read that fails."""


def _check_step(step: Any) -> int:
    """``step`` as an int (a numpy integer or an integer 0-d tensor counts, as for
    :func:`~lean_store.training.api.step_number`), from 0 to 10**19 - 1."""
    number = step_number(step)
    if number is None or not 0 <= number < 10**19:
        raise CheckpointError(f"step must be an int from 0 to 10**19 - 1 (19 digits in a "
                              f"step's name), got {step!r}")
    return number


__all__ = ["Checkpointer"]
