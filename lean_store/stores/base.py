"""The store interface: what a backend must do, in raw bits, and nothing else.

A writer creates one chunked dataset per tensor, accepts writes of whole write units (a chunk,
or a zarr shard) in C order, and commits atomically through :mod:`lean_store.stores.commit`:
everything goes to a hidden temporary sibling which is fsynced and renamed into place only when
complete (a URL: a new prefix whose root metadata, written last, is the commit marker). A reader
lists tensors, reports their attributes and storage, reads any rectangular, strided selection
of raw bits with every chunk checked, and reports what ``verify`` checks beyond the data (see
StoreReader).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..chunking import Region
from ..errors import SaveIOError
from ..layout import Entry
from .commit import Commit, is_url, refused_by_os

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Selection:
    """An ascending, strided box: per stored axis ``(start, count, step)`` with step >= 1."""

    start: tuple[int, ...]
    count: tuple[int, ...]
    step: tuple[int, ...]

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> Selection:
        return cls(tuple(0 for _ in shape), tuple(shape), tuple(1 for _ in shape))

    @classmethod
    def of_region(cls, region: Region) -> Selection:
        return cls(
            tuple(s.start for s in region),
            tuple(s.stop - s.start for s in region),
            tuple(1 for _ in region),
        )

    def slices(self) -> tuple[slice, ...]:
        return tuple(
            slice(a, a + (n - 1) * s + 1 if n else a, s)
            for a, n, s in zip(self.start, self.count, self.step)
        )


@dataclass
class StoredTensor:
    """What a reader knows about one dataset before reading its data."""

    node: str
    attrs: dict[str, Any]
    stored_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    storage: str  # "float" | "uint" | "int" | "bool" | "compound" | "native" | "raw"
    itemsize: int  # bytes per stored element as the backend sees it
    nbytes_on_disk: int | None = None
    filters: list[str] = field(default_factory=list)


class TensorWriter(ABC):
    """Writes one tensor, one write unit at a time."""

    entry: Entry
    chunk_shape: tuple[int, ...]
    write_unit: tuple[int, ...]
    small_later: bool = False
    """True when :meth:`write_small_later` may take units under 1 MiB."""

    @abstractmethod
    def write(self, region: Region, bits: np.ndarray, crc: Any = None) -> int | None:
        """Write raw words for ``region`` of the stored shape (complex: trailing axis 2).
        ``crc``: the CRC-32C of ``bits`` when the caller already has it (saves a pass), or a
        callable giving it. Returns the CRC-32C of ``bits`` when the unit was linked to an equal
        file of an earlier step (an incremental step), else None."""

    def write_later(self, region: Region, bits: np.ndarray, submit: Any) -> Any:
        """Start writing ``region`` on a worker, for a ``bits`` that stays unchanged until
        the save ends (a host tensor's own memory): ``submit(fn, *args)`` runs ``fn`` on a
        thread pool and returns its future, whose result is the CRC-32C of ``bits``. None
        (the default) where this writer writes its units in order only: use :meth:`write`."""
        return None

    def write_small_later(self, region: Region, bits: np.ndarray, crc: int, submit: Any
                          ) -> bool:
        """Queue a small unit of a ``bits`` that stays unchanged until the save ends, its
        CRC-32C ``crc`` already computed, for the store to write later on a worker (with
        ``submit``, as :meth:`write_later`). False (the default): not queued, use
        :meth:`write`."""
        return False

    @abstractmethod
    def close(self, attrs: dict[str, Any]) -> None:
        """Record final attributes (such as the digest) and release the dataset."""


class StoreWriter(ABC):
    """Creates a checkpoint at a temporary sibling and commits it atomically."""

    backend: str = ""
    makes_directory: bool = False  # the checkpoint is a directory tree (else a single file)

    def __init__(self, path: str | os.PathLike, *, chunk_bytes: int, compression: Any,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.path: str | Path = path if is_url(path) else Path(path)
        self.chunk_bytes = chunk_bytes
        self.compression = compression
        # refuses a foreign target before any byte is written (and again at the commit)
        self._commit = Commit.at(path, directory=self.makes_directory,
                                 storage_options=storage_options, one_writer=True)
        self.work = self._commit.work  # where the store is written: a temporary or the URL
        self.tmp_path = Path(self.work)  # local stores: the hidden temporary sibling
        self._done = False

    @contextmanager
    def _creating(self) -> Iterator[None]:
        """Wrap the creation of the temporary copy (in a subclass's ``__init__``): on failure,
        remove whatever was created and name the target, not the temporary."""
        try:
            yield
        except BaseException as exc:
            self._commit.abort()
            self._done = True
            if refused_by_os(exc):
                raise SaveIOError.wrapping(self.path, exc) from exc
            raise

    @abstractmethod
    def add_tensor(self, entry: Entry, attrs: dict[str, Any]) -> TensorWriter:
        """Create the dataset of ``entry`` with its attributes."""

    @abstractmethod
    def _finish(self, root_attrs: dict[str, Any]) -> None:
        """Write root attributes (``complete`` last), flush and close the temporary copy."""

    def commit(self, root_attrs: dict[str, Any]) -> None:
        """Finish (the root metadata last), then commit: fsync, and rename or exchange the
        temporary copy into place (a URL: the root metadata was the commit marker)."""
        self._finish(root_attrs)
        self._commit.commit()
        self._done = True

    def abort(self) -> None:
        """Remove the temporary copy; the previous checkpoint at ``path`` is untouched."""
        if self._done:
            return
        self._done = True
        try:
            self._close_quietly()
        finally:
            self._commit.abort()

    def _close_quietly(self) -> None:  # noqa: B027 # pragma: no cover - overridden
        pass

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
            if refused_by_os(exc):
                raise SaveIOError.wrapping(self.path, exc) from exc


ChunkProblem = tuple[tuple[int, ...] | None, str]
"""One structural defect a store found: (chunk coordinates in the chunk grid, or None for the
tensor as a whole; what is wrong)."""


@dataclass(frozen=True)
class StorageDescription:
    """How one tensor is stored, for people: ``chunk_shape`` (the store's chunks; Zarr
    sharded arrays: the inner chunks), ``codecs`` (every filter or codec, checksums included,
    in the store's own names), ``compression`` (the compressing ones alone, e.g. ``["zstd"]``;
    empty for none) and ``stored_bytes`` (bytes the tensor takes in the store, chunks, checksums
    and shard indexes included; None where the store cannot tell)."""

    chunk_shape: tuple[int, ...]
    codecs: tuple[str, ...]
    compression: tuple[str, ...]
    stored_bytes: int | None


class StoreReader(ABC):
    """Read access to one committed checkpoint.

    Every reader can: list its datasets (:meth:`nodes`), describe one (:meth:`stored`,
    :meth:`describe`), say whether its element type encodes a format (:meth:`type_mismatch`),
    read a selection with every chunk it touches checked (:meth:`read`), read one whole chunk
    unchecked and check it later (:meth:`read_unchecked`, :meth:`check_chunk`, for overlapping
    the check with the next read), check a dataset's metadata now (:meth:`check_metadata`) and
    report structural defects chunk by chunk (:meth:`structure_problems`, for ``verify``)."""

    backend: str = ""
    root_attrs: dict[str, Any]

    def stored_shape_of(self, entry: Entry) -> tuple[int, ...]:
        """The shape of the dataset this backend stores ``entry`` in."""
        return entry.shape or (1,)

    @abstractmethod
    def nodes(self) -> list[str]:
        """Node names of every dataset at the root, sorted."""

    @abstractmethod
    def stored(self, node: str) -> StoredTensor:
        """Attributes and storage description of one dataset."""

    @abstractmethod
    def describe(self, node: str) -> StorageDescription:
        """How ``node`` is stored: chunks, codecs, compression, bytes in the store."""

    @abstractmethod
    def type_mismatch(self, node: str, fmt: Any) -> str | None:
        """None when ``node``'s element type is the one lean_store writes for ``fmt``, else
        what it is instead (e.g. ``"HDF5 datatype does not encode bfloat16"``)."""

    @abstractmethod
    def read(
        self, node: str, selection: Selection, fmt: Any, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Raw words of ``selection`` (complex formats: trailing axis of 2), written into
        ``out`` (of that shape and the storage dtype) and returned as ``out`` when given.
        Every chunk the selection touches is checked against the store's per-chunk checksum."""

    @abstractmethod
    def structure_problems(self, node: str) -> list[ChunkProblem]:
        """Structural defects of ``node`` that reading its data would not show (a chunk whose
        filters were skipped, an empty slot in a shard index, no per-chunk checksum, ...)."""

    def chunk_crcs(self, node: str) -> np.ndarray | None:
        """The per-chunk CRC-32C table of ``node`` (C order of the chunk grid) when the store
        keeps one and checks every chunk read against it, else None."""
        return None

    def read_unchecked(
        self, node: str, selection: Selection, fmt: Any, out: np.ndarray
    ) -> np.ndarray:
        """One whole chunk (``selection``) read into the C-contiguous ``out`` without its
        checksum check where the store can defer it: the caller runs :meth:`check_chunk` on
        the words before using them. Stores without a CRC table check here, as :meth:`read`."""
        return self.read(node, selection, fmt, out)

    def check_chunk(self, node: str, number: int, words: np.ndarray) -> None:  # noqa: B027
        """IntegrityError unless ``words`` (chunk ``number`` in C order, whole) match the
        store's CRC table (:meth:`chunk_crcs`); nothing to do for stores without one."""

    def check_metadata(self, node: str) -> None:  # noqa: B027 - most stores: done when opened
        """Check ``node``'s metadata now, as a read would before its first data (Zarr: the
        array's own ``zarr.json`` against its copy in the root)."""

    def check_region(self, node: str, box: Any) -> None:  # noqa: B027 - checked when opened
        """Check now what a read of ``box`` (global coordinates) of ``node`` will touch: for
        stores that defer checks of parts of a checkpoint until a read needs them (sharded
        HDF5 opened with deferred source checks); most stores checked everything when opened."""

    def checked_elsewhere(self, node: str, box: Any) -> None:  # noqa: B027 - nothing to skip
        """The part ``box`` of ``node`` was read whole and checked by another process and every
        process agreed: a store may skip checks of it it would otherwise repeat."""

    def metadata_checked_elsewhere(self, node: str) -> None:  # noqa: B027 - nothing to skip
        """Another process ran :meth:`check_metadata` on ``node`` and every process agreed: a
        store may skip it here."""

    def check_current(self) -> None:  # noqa: B027 - stores that read one open file: nothing
        """Raise :class:`~lean_store.errors.CheckpointReplacedError` when the checkpoint this
        reader opened has been replaced (or removed) at its path and what the reader fetched
        since opening may come from another checkpoint."""

    @contextmanager
    def checks_deferred(self) -> Iterator[None]:
        """Reads inside the block whose data nobody uses before it ends (a whole tensor read
        into one buffer, a verify pass): a store that checks for replacement after every read
        may check once, when the block ends without error, instead."""
        yield

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
