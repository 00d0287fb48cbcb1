"""Saves to one local path, in one process, end with the state of the last one called.

Two saves to the same path may run at once: a background save (``blocking=False``) still
writing when the next one starts, or a blocking save called meanwhile. Each publishes its
temporary when its write ends, so a long save called first could publish after a short save
called later, and the path then held the older state. Here each save takes a :class:`Turn`
when it is called (a background save in the caller's thread, :func:`reserve`, before its
thread starts); at its commit it publishes only if no save to that path called after it has
published already, else it discards what it wrote (the path holds newer state). The check and
the rename are one step under the path's lock. Saves from other processes are not ordered
(a path belongs to one writer, docs/TRAINING.md).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..fork_safe import ForkSafeLock


@dataclass
class _PathTurns:
    lock: ForkSafeLock = field(default_factory=ForkSafeLock)  # a commit's check and rename
    issued: int = 0  # turns handed out
    published: int = -1  # the newest turn that published
    open: int = 0  # turns not released yet


_LOCK = ForkSafeLock()
_PATHS: dict[str, _PathTurns] = {}
_RESERVED = threading.local()  # .turn: a background save's turn, taken by its commit


def key_of(path: str | os.PathLike[str]) -> str:
    """One key per path whatever its spelling (relative, absolute, through a linked
    directory): the real directory and the name. A relative path in a working directory
    that was removed is its own key (the save then fails to write there, and says so)."""
    try:
        p = Path(os.path.abspath(path))
        return os.path.join(os.path.realpath(p.parent), p.name)
    except OSError:
        return os.fspath(path)


class Turn:
    """A save's place in the order of the saves to its path."""

    def __init__(self, key: str) -> None:
        self.key = key
        with _LOCK:
            turns = _PATHS.get(key)
            if turns is None:
                turns = _PATHS[key] = _PathTurns()
            self.number = turns.issued
            turns.issued += 1
            turns.open += 1
        self._turns = turns
        self._released = False
        self.taken = False  # by a commit (:func:`take`), for a turn reserved ahead

    @contextmanager
    def publishing(self) -> Iterator[bool]:
        """Yields whether this save is to publish (no save called after it has); the
        caller renames inside the block, which counts as published if it ends without an
        error. Other commits to the path wait for the block."""
        with self._turns.lock:
            latest = self._turns.published < self.number
            yield latest
            if latest:
                self._turns.published = self.number

    def release(self) -> None:
        """This save is over (committed, discarded or failed). Idempotent."""
        with _LOCK:
            if self._released:
                return
            self._released = True
            self._turns.open -= 1
            if self._turns.open == 0 and _PATHS.get(self.key) is self._turns:
                del _PATHS[self.key]  # no save to order against: forgotten


def pending(path: str | os.PathLike[str]) -> int:
    """How many saves to ``path`` in this process have a turn not released yet."""
    with _LOCK:
        turns = _PATHS.get(key_of(path))
        return 0 if turns is None else turns.open


def reserve(path: str | os.PathLike[str]) -> Turn:
    """A turn taken now, for a save that will run in another thread (:func:`reserved`)."""
    return Turn(key_of(path))


@contextmanager
def reserved(turn: Turn | None) -> Iterator[None]:
    """Inside: the first :func:`take` for ``turn``'s path in this thread gets ``turn``. A turn
    no commit took is released at the end (the save failed before it had one)."""
    if turn is None:
        yield
        return
    _RESERVED.turn = turn
    try:
        yield
    finally:
        _RESERVED.turn = None
        if not turn.taken:
            turn.release()


def take(path: str | os.PathLike[str]) -> Turn:
    """The turn of a save to ``path`` starting in this thread: its reserved one, else new."""
    key = key_of(path)
    turn: Turn | None = getattr(_RESERVED, "turn", None)
    if turn is not None and turn.key == key and not turn.taken:
        turn.taken = True
        return turn
    return Turn(key)


__all__ = ["Turn", "key_of", "pending", "reserve", "reserved", "take"]
