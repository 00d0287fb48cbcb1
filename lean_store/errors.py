"""Typed errors. Every failure lean_store reports is a :class:`CheckpointError`."""

from __future__ import annotations

MAX_LISTED = 20  # problems one error message names; the rest are counted


class CheckpointError(Exception):
    """Base class of every error lean_store raises on purpose."""


class FormatError(CheckpointError):
    """A scalar format is unknown, impossible, or does not match what was asked for."""


class LayoutError(CheckpointError):
    """Tensors are missing, extra, mis-shaped, mis-typed or out of order.

    ``differences`` lists every mismatch found, not only the first one.
    """

    def __init__(self, message: str, differences: list | None = None) -> None:
        super().__init__(message)
        self.differences = list(differences or [])


class IntegrityError(CheckpointError):
    """Stored bytes are incomplete, corrupt, or not a lean_store checkpoint."""


class UnsafeFileError(IntegrityError):
    """A file tries to reach outside the checkpoint or to make the reader allocate absurd sizes."""


class UnsupportedValueError(CheckpointError):
    """A state entry cannot be stored as a tensor (not a tensor, sparse, meta, quantized, ...);
    the message names the entry and what to do instead."""


def listing(lines: list[str], limit: int = MAX_LISTED) -> str:
    """``lines`` as an indented list for an error message: the first ``limit`` of them and a
    count of the rest, so that a message stays short however many problems a file has."""
    shown = "\n".join(f"  - {line}" for line in lines[:limit])
    rest = len(lines) - limit
    return shown + (f"\n  ... and {rest} more" if rest > 0 else "")
