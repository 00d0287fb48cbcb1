"""Byte-counting progress: a rich bar on a terminal when asked (or for big jobs), else silent."""

from __future__ import annotations

import sys
from typing import Any

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


def make_progress(progress: Any, description: str, total: int) -> NullProgress:
    """``progress``: True/False, None for automatic (a terminal and a big job), or a stream."""
    if progress is None:
        if not (sys.stderr.isatty() and total >= AUTO_THRESHOLD_BYTES):
            return NullProgress()
        progress = True
    if progress is False:
        return NullProgress()
    stream = sys.stderr if progress is True else progress
    try:
        return RichProgress(description, total, stream)
    except ImportError:  # rich is optional: no bar rather than a failure
        return NullProgress()
