"""Typed errors. Every failure lean_store reports is a :class:`CheckpointError`."""

from __future__ import annotations

import errno
import os
from typing import Any

MAX_LISTED = 20  # problems one error message names; the rest are counted


class CheckpointError(Exception):
    """Base class of every error lean_store raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled whole (an error raised in a DataLoader worker or a process pool reaches the
        parent as it was raised): rebuilt from its arguments and attributes without calling
        ``__init__`` again, which takes other arguments than the message it made."""
        return (_rebuilt, (type(self), self.args, dict(self.__dict__)))


def _rebuilt(cls: type[CheckpointError], args: tuple[Any, ...],
             state: dict[str, Any]) -> CheckpointError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


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


class ForeignPathError(CheckpointError):
    """A save would replace something that is not a lean_store checkpoint; it is left untouched.

    ``path`` is the target, ``found`` says what is there (a directory with N entries, a regular
    file, a non-lean_store HDF5 file, a symbolic link, ...). Built with :meth:`at`.
    """

    def __init__(self, message: str, *, path: str | None = None, found: str | None = None):
        super().__init__(message)
        self.path = path
        self.found = found

    @classmethod
    def at(cls, path: object, found: str, *, wanted: str | None = None) -> ForeignPathError:
        """``wanted``: the kind of file an interop writer may replace (default: a checkpoint)."""
        if wanted is not None:
            return cls(
                f"refusing to replace {path}: it is {found}; a writer of {wanted} replaces only "
                "a file of that kind. Remove it first to overwrite it on purpose, or write to "
                "another path", path=str(path), found=found,
            )
        return cls(
            f"refusing to replace {path}: it is {found}, not a lean_store checkpoint; "
            "lean_store replaces only its own checkpoints (and empty directories). Remove it "
            "first to overwrite it on purpose, or save to another path",
            path=str(path), found=found,
        )


class SaveIOError(CheckpointError, OSError):
    """The operating system refused a write of a save (read-only file system, full disk, ...).

    An :class:`OSError` too: ``errno`` and ``strerror`` are the original error's, ``filename``
    is the target path (never the hidden temporary, which has been removed). Built with
    :meth:`wrapping`.
    """

    def __init__(self, message: str, code: int | None = None, filename: str | None = None):
        if code is None:  # rebuilt from its message alone (another rank's report)
            super().__init__(message)
        else:
            super().__init__(code, os.strerror(code), filename)
        self.message = message

    @classmethod
    def wrapping(cls, path: object, cause: OSError) -> SaveIOError:
        code = cause.errno if isinstance(cause.errno, int) else None
        reason = os.strerror(code) if code is not None else str(cause)
        name = errno.errorcode.get(code, "") if code is not None else ""
        return cls(
            f"cannot save to {path}: {reason}{f' ({name})' if name else ''}; nothing was "
            "written there and the previous contents, if any, are untouched",
            code, str(path),
        )

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:  # an OSError: its own constructor rebuilds it
        return (type(self), (self.message, self.errno, self.filename))


class TensorNotFoundError(CheckpointError, KeyError):
    """A tensor name the checkpoint does not hold (also a ``KeyError``, as a mapping's)."""

    def __str__(self) -> str:  # the message, not KeyError's repr of it
        return str(self.args[0]) if self.args else ""


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


class CheckpointBusyError(CheckpointError):
    """An HDF5 checkpoint file is open for writing in another process (HDF5's file lock is
    held there), so lean_store does not read it: its bytes may be changing. Nothing is wrong
    with the file. ``path``: the file."""

    def __init__(self, path: object, detail: str = "") -> None:
        self.path = str(path)
        more = f" ({detail})" if detail else ""
        super().__init__(
            f"{self.path} is open for writing in another process, which holds HDF5's lock on "
            f"it{more}; lean_store does not read a checkpoint that may be changing. Close it "
            "there (h5py.File(path, 'r') reads it without blocking others), or set "
            "HDF5_USE_FILE_LOCKING=FALSE to read it anyway (every chunk is still checked)"
        )


class UnsupportedValueError(CheckpointError):
    """A state entry cannot be stored as a tensor (not a tensor, sparse, meta, quantized, ...);
    the message names the entry and what to do instead."""


def listing(lines: list[str], limit: int = MAX_LISTED) -> str:
    """``lines`` as an indented list for an error message: the first ``limit`` of them and a
    count of the rest, so that a message stays short however many problems a file has."""
    shown = "\n".join(f"  - {line}" for line in lines[:limit])
    rest = len(lines) - limit
    return shown + (f"\n  ... and {rest} more" if rest > 0 else "")
