"""Typed errors. Every failure lean_store reports is a :class:`CheckpointError`."""

from __future__ import annotations


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
