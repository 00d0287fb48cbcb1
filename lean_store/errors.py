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


class CheckpointReplacedError(CheckpointError):
    """The checkpoint was replaced (by a new save to its path) or removed while open.

    An open checkpoint reads only the checkpoint it opened; when that is no longer possible,
    this is raised instead of returning data of another checkpoint. Open the path again.
    """

    def __init__(self, path: object, detail: str = "") -> None:
        self.path = str(path)
        more = f" ({detail})" if detail else ""
        super().__init__(
            f"{self.path} was replaced by a newer save (or removed) while open{more}; "
            "open it again to read the current checkpoint"
        )
