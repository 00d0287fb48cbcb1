"""``SaveOptions``: every option of a save, in one frozen object.

``ls.save``, ``ls.save_async``, ``ls.training.save_training``, ``save_optimizer`` and
``Checkpointer`` all take ``options=SaveOptions(...)``; each field may also be passed as a
keyword of the same name. Passing a field both ways is an error, never a silent choice.
A path that cannot honour an option given raises a :class:`~lean_store.CheckpointError`
naming it (see docs/API.md for which path honours what).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .chunking import MIN_CHUNK_BYTES
from .errors import CheckpointError
from .progress import check_progress
from .snapshot import SNAPSHOTS


@dataclass(frozen=True)
class SaveOptions:
    """How a checkpoint is written. Every field's default is the library's one default.

    - ``chunk_bytes``: target bytes of one stored chunk (None: 4 MiB; at least 4 KiB).
    - ``compression``: None (none), ``"gzip"``/``"zstd"``/... or a codec spec (see GUIDE.md).
    - ``checksum``: None (the backend's default), ``"crc32c"`` or, HDF5 only,
      ``"fletcher32+crc32c"`` (adds HDF5's native fletcher32 filter).
    - ``progress``: None (a bar on a terminal, for big jobs only), True (a bar on a terminal),
      False (none) or a stream to draw the bar on.
    - ``buffer_bytes``: host staging buffers for device tensors (None: 64 MiB).
    - ``snapshot``: how a ``blocking=False`` save freezes the state (``"auto"``, ``"device"``,
      ``"host"``, ``"none"``; see :mod:`lean_store.async_save`).
    - ``storage_options``: fsspec options (endpoint, credentials) for a URL path.
    """

    chunk_bytes: int | None = None
    compression: Any = None
    checksum: str | None = None
    progress: Any = None
    buffer_bytes: int | None = None
    snapshot: str = "auto"
    storage_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("chunk_bytes", "buffer_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise CheckpointError(f"SaveOptions.{name} must be an int or None, got {value!r}")
        if self.chunk_bytes is not None and self.chunk_bytes < MIN_CHUNK_BYTES:
            raise CheckpointError(f"SaveOptions.chunk_bytes must be at least {MIN_CHUNK_BYTES}, "
                                  f"got {self.chunk_bytes}")
        if self.buffer_bytes is not None and self.buffer_bytes < 1:
            raise CheckpointError(
                f"SaveOptions.buffer_bytes must be positive, got {self.buffer_bytes}"
            )
        check_progress(self.progress)
        if self.checksum is not None and not isinstance(self.checksum, str):
            raise CheckpointError(f"SaveOptions.checksum must be a string, got {self.checksum!r}")
        if self.snapshot not in SNAPSHOTS:
            raise CheckpointError(
                f"SaveOptions.snapshot: unknown snapshot {self.snapshot!r}; use one of {SNAPSHOTS}"
            )
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise CheckpointError("SaveOptions.storage_options must be a dict or None")

    def replace(self, **changes: Any) -> SaveOptions:
        """A copy with ``changes`` applied (checked like a new one)."""
        return dataclasses.replace(self, **changes)

    def given(self) -> list[str]:
        """The fields that differ from their defaults, in declaration order."""
        return [f.name for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default]


FIELDS = tuple(f.name for f in dataclasses.fields(SaveOptions))


def merge_options(options: SaveOptions | None, base: SaveOptions | None = None,
                  **keywords: Any) -> SaveOptions:
    """One ``SaveOptions`` from ``options=`` and the keywords of the same names (None: not
    given). ``base`` (e.g. a Checkpointer's) applies when ``options`` is None; a keyword
    overrides ``base``, and adds to ``options``, but may not set a field ``options`` sets."""
    unknown = sorted(set(keywords) - set(FIELDS))
    if unknown:
        raise CheckpointError(f"unknown save options {unknown}; SaveOptions has {list(FIELDS)}")
    given = {name: value for name, value in keywords.items() if value is not None}
    if options is not None and not isinstance(options, SaveOptions):
        raise CheckpointError(
            f"options must be a lean_store.SaveOptions, got {type(options).__name__}"
        )
    if base is not None and not isinstance(base, SaveOptions):
        raise CheckpointError(
            f"options must be a lean_store.SaveOptions, got {type(base).__name__}"
        )
    if options is not None:
        both = [name for name in FIELDS if name in given and name in options.given()]
        if both:
            raise CheckpointError(
                f"save option {', '.join(both)} given both as a keyword and in options=; "
                "pass each option one way"
            )
        return options.replace(**given)
    return (base or SaveOptions()).replace(**given)


def refuse(options: SaveOptions, names: tuple[str, ...] | list[str], where: str,
           why: str = "") -> None:
    """Raise a CheckpointError naming each of ``names`` that ``options`` sets (differs from its
    default): the path ``where`` cannot honour it."""
    defaults = SaveOptions()
    bad = [n for n in names if getattr(options, n) != getattr(defaults, n)]
    if bad:
        reason = f": {why}" if why else ""
        raise CheckpointError(
            f"save option {', '.join(bad)} is not supported by {where}{reason}"
        )


__all__ = ["SNAPSHOTS", "SaveOptions", "merge_options", "refuse"]
