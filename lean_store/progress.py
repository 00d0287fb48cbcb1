"""Byte-counting progress: a rich bar on a terminal when asked (or for big jobs), else silent."""

from __future__ import annotations

import sys
from typing import Any

from .errors import CheckpointError

AUTO_THRESHOLD_BYTES = 256 << 20


class NullProgress:
    def advance(self, nbytes: int) -> None:
        pass

    def __enter__(self) -> NullProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class RichProgress(NullProgress):
    def __init__(self, description: str, total: int, stream: Any) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(file=stream, force_terminal=True if stream is not sys.stderr else None),
            transient=False,
        )
        self._task = self._progress.add_task(description, total=total)

    def advance(self, nbytes: int) -> None:
        self._progress.update(self._task, advance=nbytes)

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def check_progress(progress: Any) -> None:
    """CheckpointError unless ``progress`` is None, a bool or a stream with ``write()``."""
    if not (progress is None or isinstance(progress, bool)
            or callable(getattr(progress, "write", None))):
        raise CheckpointError(f"progress must be None, True, False or a stream with write(), "
                              f"got {progress!r:.60}")


def make_progress(progress: Any, description: str, total: int) -> NullProgress:
    """A bar with bytes, bytes/s and ETA, or a silent stand-in.

    ``progress``: False for none; True for a bar on stderr when it is a terminal (nothing
    otherwise, so logs stay clean); None (automatic) for a bar when stderr is a terminal and the
    job has at least ``AUTO_THRESHOLD_BYTES``; or a writable stream to draw the bar on, always.
    """
    check_progress(progress)
    if progress is None:
        if not (_is_terminal(sys.stderr) and total >= AUTO_THRESHOLD_BYTES):
            return NullProgress()
        progress = True
    if progress is False:
        return NullProgress()
    if progress is True and not _is_terminal(sys.stderr):
        return NullProgress()
    stream = sys.stderr if progress is True else progress
    try:
        return RichProgress(description, total, stream)
    except ImportError:  # rich is optional: no bar rather than a failure
        return NullProgress()
