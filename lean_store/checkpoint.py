"""Reading: ``open`` (a validated ``Checkpoint``), ``load`` (single process, in place) and
``load_state``: store -> validate -> stream -> target. Saving lives in :mod:`lean_store.api`
(the API layer) and :mod:`lean_store.writing` (the save pipeline)."""

from __future__ import annotations

import difflib
import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .chunking import (
    DEFAULT_CHUNK_BYTES,
    Region,
    iter_regions,
    plan_chunks,
    splits_into_row_blocks,
)
from .distributed.sharded_read import StoredShard, stored_shards
from .encoded import Encoded
from .errors import (
    CheckpointError,
    CheckpointReplacedError,
    FormatError,
    IntegrityError,
    LayoutError,
    TensorNotFoundError,
)
from .fork_safe import ForkSafeLock
from .formats import ScalarFormat, get
from .gc_pause import collection_paused
from .indexing import basic_index
from .integrity import crc32c_combine, crc32c_update
from .layout import Difference, Entry, Layout, layout_error, stored_rank_shape
from .metadata import check_stored, parse_root
from .progress import make_progress
from .read_ahead import read_all
from .sources import TargetTensor, after_load, template_layout, tensor_targets
from .sources.base import fitted_to_stored, prepared
from .sources.module_names import respelled, spelled_as
from .stores.base import ChunkProblem, Selection, StorageDescription, StoredTensor
from .stores.commit import at_call_time, is_url
from .stores.registry import open_reader
from .writing import OVERLAP_CRC_BYTES

OPEN_ATTEMPTS = 3
"""Times ``open``, ``load`` and ``load_state`` start over when a save replaces the checkpoint
while they read it."""
KEPT_VERIFIED_BYTES = 64 << 20
"""``load`` keeps the words its verify pass read, tensor by tensor while they fit in this many
bytes in all, and installs them without reading them again (small tensors' second read is
most of their cost); the other tensors are read again at install, as before."""
_CHECKER_LOCK = ForkSafeLock()
T = TypeVar("T")


# ---------------------------------------------------------------------------------- reading


class TensorHandle:
    """One stored tensor: metadata now, data on demand (only the chunks a slice touches)."""

    def __init__(self, checkpoint: Checkpoint, entry: Entry, stored: StoredTensor) -> None:
        self._ck = checkpoint
        self.entry = entry
        self.stored = stored

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with its checkpoint (see :meth:`Checkpoint.__reduce__`)."""
        return (_handle_of, (self._ck, self.entry.name))

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def ndim(self) -> int:
        return len(self.entry.shape)

    @property
    def size(self) -> int:
        return math.prod(self.entry.shape)

    @property
    def format(self) -> ScalarFormat:
        return self.entry.format

    @property
    def dtype(self) -> np.dtype | None:
        """The numpy dtype of the values, or None where only ``Encoded`` can hold them."""
        return self.entry.format.numpy_dtype

    @property
    def chunks(self) -> tuple[int, ...]:
        return self.stored.chunk_shape

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes

    def bits(self, key: Any = ...) -> np.ndarray:
        """Raw words of ``self[key]`` (complex formats: trailing axis of 2); every chunk the
        slice touches is checked against its checksum (the whole-tensor digest is not)."""
        self._ck._entry(self.name)  # the checkpoint still open
        index = basic_index(key, self.shape)
        words = self._ck._reader.read(self.stored.node, index.selection, self.format)
        return index.finish(words, self.format.words_per_value == 2)

    def __getitem__(self, key: Any) -> np.ndarray | Encoded:
        return as_values(self.bits(key), self.format)

    def read(self) -> np.ndarray | Encoded:
        """The whole tensor, every chunk checksum and its digest verified."""
        return self._ck.read(self.name)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        values = self.read()
        if isinstance(values, Encoded):
            raise FormatError(
                f"{self.name!r} is {self.format.tag}, which has no numpy dtype; use .read() for "
                "an Encoded value, or .read().decode() for float64 values"
            )
        return values if dtype is None else values.astype(dtype)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a scalar tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"<tensor {self.name!r} {self.format.tag}{list(self.shape)}>"


_SUGGEST_AMONG = 5000


def _not_found(name: str, names: list[str], path: Any) -> str:
    """The message for a tensor name ``path`` does not hold: the closest names it holds."""
    count = len(names)
    if not isinstance(name, str):  # ck[0], 0 in ck: names are strings (a KeyError, as dicts)
        return (f"no tensor {name!r} in {path} ({count} tensors): tensor names are strings, "
                f"not {type(name).__name__}; the names in order are list(checkpoint)")
    if count > _SUGGEST_AMONG:  # difflib compares with each: those ending alike only
        last = name.rsplit(".", 1)[-1]
        names = [n for n in names if n.endswith(last)][:_SUGGEST_AMONG]
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    return f"no tensor {name!r} in {path} ({count} tensors){hint}"


def as_values(words: np.ndarray, fmt: ScalarFormat) -> np.ndarray | Encoded:
    """Words as a numpy array of the format's dtype, or ``Encoded`` where none exists."""
    dtype = fmt.numpy_dtype
    if dtype is None:
        return Encoded(words, fmt)
    if fmt.words_per_value == 2:
        return np.ascontiguousarray(words).view(dtype).reshape(words.shape[:-1])
    return words.view(dtype)


OnError = Callable[[Region | None, CheckpointError], None]
"""``blocks(on_error=...)``: called with (the region, the error) for a block that fails its
checks, or (None, the error) for a digest mismatch; the stream then goes on."""


class Checkpoint(Mapping[str, TensorHandle]):
    """A read-only, validated view of a checkpoint. Use as a context manager.

    The read interface: :meth:`stored` (how a tensor is stored), :meth:`shards` (its recorded
    shards), :meth:`describe`, :meth:`blocks` (verified blocks in order), :meth:`read` and
    :meth:`read_bits` (whole, verified), :meth:`read_region` (a region, chunk-checked) and
    :meth:`verify`. ``ck[name]`` is a :class:`TensorHandle` for slicing."""

    def __init__(self, path: Any, *, backend: str | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.path = path
        self._closed = False
        # where a pickled handle opens it again: the path as meant now (the working directory
        # may change), or None for a store or file object
        self._reopen_at = at_call_time(os.fsdecode(path)) if isinstance(
            path, (str, bytes, os.PathLike)) else None
        self._storage_options = storage_options
        self._pool: ThreadPoolExecutor | None = None  # checks chunks while reading ahead
        for attempt in range(OPEN_ATTEMPTS):  # a save replaced the path while it was opened
            try:
                with collection_paused():  # the open's records are in no cycles (.gc_pause)
                    self._open(path, backend, storage_options)
                return
            except CheckpointReplacedError:
                if attempt == OPEN_ATTEMPTS - 1:
                    raise

    def _open(
        self, path: Any, backend: str | None, storage_options: dict[str, Any] | None
    ) -> None:
        """Open the reader and read every piece of metadata; then check the store is still
        the one opened, so that the metadata all comes from one checkpoint."""
        self._reader = open_reader(path, backend, storage_options)
        try:
            self.backend = self._reader.backend
            self.root_attrs = self._reader.root_attrs
            self.format_version, self.kind, self.layout = parse_root(
                self.root_attrs, str(path), present=lambda: len(self._reader.nodes())
            )
            self._stored = check_stored(self._reader, self.layout, str(path))
            # {} unless saved by lean_store.distributed
            self._shards = stored_shards(self.root_attrs, self.layout, self._stored, str(path))
            self._reader.check_current()
        except BaseException as exc:
            replaced = None
            if isinstance(exc, CheckpointError) and not isinstance(exc, CheckpointReplacedError):
                try:  # metadata of two checkpoints mixed by a save is no sign of damage
                    self._reader.check_current()
                except CheckpointReplacedError as err:
                    replaced = err
            self._reader.close()
            if replaced is not None:
                raise replaced from None
            raise

    def __getitem__(self, name: str) -> TensorHandle:
        return TensorHandle(self, self._entry(name), self._stored[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names())

    def __len__(self) -> int:
        return len(self.layout)

    # ------------------------------------------------------------------ what is stored

    def _entry(self, name: str) -> Entry:
        if self._closed:
            raise CheckpointError(f"{self.path} was closed: open it again to read from it")
        if name not in self.layout:
            raise TensorNotFoundError(_not_found(name, self.layout.names(), self.path))
        return self.layout[name]

    def stored(self, name: str) -> StoredTensor:
        """How tensor ``name`` is stored: dataset node, attributes, stored and chunk shapes."""
        self._entry(name)
        return self._stored[name]

    def shards(self, name: str) -> list[StoredShard]:
        """The recorded shards of tensor ``name`` (each with its box, writer rank and digest),
        validated when the checkpoint was opened; [] unless saved by lean_store.distributed."""
        self._entry(name)
        return list(self._shards.get(name, ()))

    def check_region(self, name: str, box: Any) -> None:
        """Have the store check, before any read, everything a read of ``box`` (a
        :class:`~lean_store.distributed.Box` of global coordinates) of ``name`` will touch
        (the shard files' datasets of a sharded HDF5 checkpoint opened with deferred checks)."""
        self._reader.check_region(self.stored(name).node, box)

    def checked_elsewhere(self, name: str, k: int) -> None:
        """Shard ``k`` of ``name`` was read whole, its digest and attributes checked, by another
        process, and every process agreed: the store need not compare its attributes again."""
        self._reader.checked_elsewhere(self.stored(name).node, self.shards(name)[k].box)

    def check_metadata(self, name: str) -> None:
        """Have the store check ``name``'s own metadata against what it was opened from now,
        as a read does before its first data (Zarr: the array's ``zarr.json`` against the root's
        copy; sharded HDF5: the master dataset against the master manifest)."""
        self._reader.check_metadata(self.stored(name).node)

    def metadata_checked_elsewhere(self, name: str) -> None:
        """Another process ran :meth:`check_metadata` on ``name`` and every process agreed: the
        store need not repeat it."""
        self._reader.metadata_checked_elsewhere(self.stored(name).node)

    def describe(self, name: str) -> StorageDescription:
        """Chunks, codecs, compression and bytes in the store of tensor ``name``."""
        return self._reader.describe(self.stored(name).node)

    def structure_problems(self, name: str) -> list[ChunkProblem]:
        """Defects of tensor ``name``'s storage that reading its data would not show (see
        :meth:`lean_store.stores.base.StoreReader.structure_problems`)."""
        return self._reader.structure_problems(self.stored(name).node)

    # ------------------------------------------------------------------------- reading

    def read_region(self, name: str, region: Region, out: np.ndarray | None = None
                    ) -> np.ndarray:
        """Raw words of ``region`` (slices of the stored shape: ``(1,)`` for a scalar;
        complex formats: trailing axis of 2), into ``out`` when given. Every chunk it touches
        is checked against its checksum; the whole-tensor digest is not (see :meth:`blocks`)."""
        entry = self._entry(name)
        return self._reader.read(self._stored[name].node, Selection.of_region(region),
                                 entry.format, out)

    def read_bits(self, name: str) -> np.ndarray:
        """The whole tensor's raw words, shaped ``shape`` (+ ``(2,)`` for complex formats),
        every chunk checksum and the digest verified before it is returned."""
        entry = self._entry(name)
        pair = (2,) if entry.format.words_per_value == 2 else ()
        out = np.empty(stored_rank_shape(entry) + pair, dtype=entry.format.storage_dtype)
        self._read_whole(entry, out)
        return out.reshape(entry.shape + pair)

    def read(self, name: str) -> np.ndarray | Encoded:
        """The whole tensor ``name`` as values (``Encoded`` where numpy has no dtype), every
        chunk checksum and the digest verified."""
        return as_values(self.read_bits(name), self._entry(name).format)

    def blocks(
        self,
        name: str,
        *,
        block_bytes: int | None = None,
        unit: tuple[int, ...] | None = None,
        shard: int | None = None,
        out: np.ndarray | None = None,
        reuse: bool = False,
        on_error: OnError | None = None,
    ) -> Iterator[tuple[Region, np.ndarray]]:
        """Raw words of tensor ``name`` block by block, as ``(region, words)`` pairs; a block
        is handed out only once every chunk in it passed its checksum, and the tensor's
        crc32c digest is checked after the last block (IntegrityError).

        Blocks are the store's chunks where they split the tensor into row blocks (then each
        chunk's recorded CRC gives the digest, and big chunks are checked in a worker thread
        while the next is read), else row blocks of about 64 MiB; ``unit`` (a row-block
        shape) or ``block_bytes`` choose other row blocks. A sharded tensor comes shard by
        shard, each shard's digest checked; with ``unit`` or ``block_bytes`` its shards are
        checked first and the blocks then come in C order. ``shard=k``: shard ``k`` alone.
        ``out`` (stored shape, storage dtype): each block is read straight into it.
        ``reuse``: blocks share scratch buffers, valid until the next block.
        ``on_error``: report a failing block or digest and go on (see :data:`OnError`)."""
        entry = self._entry(name)
        shape = stored_rank_shape(entry)
        shards = self._shards.get(name) or []
        if shard is not None:
            if not 0 <= shard < len(shards):
                raise CheckpointError(f"tensor {name!r} has {len(shards)} recorded shards, "
                                      f"not a shard {shard}")
            return self._shard_blocks(entry, shards[shard], out, reuse, on_error)
        if unit is None and block_bytes is not None:
            itemsize = entry.format.storage_dtype.itemsize * entry.format.words_per_value
            unit = plan_chunks(shape, itemsize, block_bytes)
        if unit is not None and not splits_into_row_blocks(shape, tuple(unit)):
            raise CheckpointError(f"tensor {name!r}: blocks of {tuple(unit)} are not row blocks "
                                  f"of its shape {shape}")
        if shards:
            return self._sharded_blocks(entry, shards, unit, out, reuse, on_error)
        return self._tensor_blocks(entry, unit, out, reuse, on_error)

    def verified_words(self, name: str) -> tuple[Region, np.ndarray]:
        """``(region, words)`` of the whole tensor ``name`` as :meth:`blocks` gives its
        blocks (the region over the stored shape, the raw words), its own metadata checked
        as :meth:`verify` checks it, every chunk checksum and the digest verified."""
        entry = self._entry(name)
        self._reader.check_metadata(self.stored(name).node)
        shape = stored_rank_shape(entry)
        pair = (2,) if entry.format.words_per_value == 2 else ()
        out = np.empty(shape + pair, dtype=entry.format.storage_dtype)
        self._read_whole(entry, out)
        return tuple(slice(0, n) for n in shape), out

    def verify(self, names: Iterable[str] | None = None) -> None:
        """Read every tensor (or those of ``names``) and check every chunk checksum and
        digest; IntegrityError at the first problem (:func:`lean_store.verify` lists all)."""
        for name in self.layout.names() if names is None else names:
            self._reader.check_metadata(self.stored(name).node)
            with self._reader.checks_deferred():
                for _ in self.blocks(name, reuse=True):
                    pass

    def _read_whole(self, entry: Entry, out: np.ndarray) -> None:
        """Read the whole tensor into ``out`` (stored shape, storage dtype), every chunk
        checksum and the digest verified; ``out`` is handed out only by the caller, after.

        A tensor stored as one chunk (most tensors of a model state) is one region: it is read
        here with the same store calls, in the same order, as :meth:`_stream` makes for it
        (table looked up first, the store's checked read, the digest from the table's entry
        read after it, or a CRC pass without a table), without building the block stream."""
        info = self._stored[entry.name]
        shape = stored_rank_shape(entry)
        reader = self._reader
        with reader.checks_deferred():  # ``out`` is handed out only at the end
            if info.chunk_shape != shape or entry.name in self._shards or 0 in shape:
                for _ in self.blocks(entry.name, out=out):  # each block is read in place
                    pass
                return
            table = reader.chunk_crcs(info.node)
            words = reader.read(info.node, Selection.whole(shape), entry.format, out=out)
            expected = info.attrs.get("crc32c")
            if expected is None:
                return
            crc = int(table[0]) if table is not None else crc32c_update(0, words)
            if crc != expected:
                reader.check_current()  # replaced while read: not damage
                raise IntegrityError(_digest_mismatch(entry.name, crc, expected))

    # ------------------------------------------------------- the one verified stream

    def _tensor_blocks(self, entry: Entry, unit: tuple[int, ...] | None, out: np.ndarray | None,
                       reuse: bool, on_error: OnError | None
                       ) -> Iterator[tuple[Region, np.ndarray]]:
        shape = stored_rank_shape(entry)
        info = self._stored[entry.name]
        if unit is None:
            unit = info.chunk_shape[: len(shape)]
            if not splits_into_row_blocks(shape, unit):
                unit = plan_chunks(shape, entry.format.storage_dtype.itemsize,
                                   DEFAULT_CHUNK_BYTES)
        unit = tuple(unit)
        # blocks that are the store's chunks: the digest follows from the chunks' CRCs
        table = self._reader.chunk_crcs(info.node) if unit == info.chunk_shape else None
        expected = info.attrs.get("crc32c")

        def mismatch(crc: int, recorded: int) -> str:
            return _digest_mismatch(entry.name, crc, recorded)

        overlap = table is not None and _worth_overlap(info, entry)
        return self._stream(entry, iter_regions(shape, unit), table, expected, mismatch, out,
                            reuse, on_error, overlap)

    def _shard_blocks(self, entry: Entry, shard: StoredShard, out: np.ndarray | None,
                      reuse: bool, on_error: OnError | None
                      ) -> Iterator[tuple[Region, np.ndarray]]:
        """One shard in its digest order: blocks of its ``unit``, in C order of the shard."""
        regions = (tuple(slice(s.start + o, s.stop + o) for s, o in zip(local, shard.box.offsets))
                   for local in iter_regions(shard.box.lengths, shard.unit))

        def mismatch(crc: int, recorded: int) -> str:
            return (f"tensor {entry.name!r}: shard {shard.box} (written by rank {shard.rank}) "
                    f"has crc32c {crc:#010x}, the recorded digest is {recorded:#010x}; the "
                    "checkpoint is corrupt")

        return self._stream(entry, regions, None, shard.crc32c, mismatch, out, reuse, on_error,
                            False)

    def _sharded_blocks(self, entry: Entry, shards: list[StoredShard],
                        unit: tuple[int, ...] | None, out: np.ndarray | None, reuse: bool,
                        on_error: OnError | None) -> Iterator[tuple[Region, np.ndarray]]:
        if math.prod(stored_rank_shape(entry)) == 0:
            return
        if unit is None:
            for shard in shards:
                yield from self._shard_blocks(entry, shard, out, reuse, on_error)
            return
        for shard in shards:  # every digest first; then the blocks asked for, in C order
            for _ in self._shard_blocks(entry, shard, None, True, on_error):
                pass
        yield from self._stream(entry, iter_regions(stored_rank_shape(entry), unit), None, None,
                                None, out, reuse, on_error, False)

    def _stream(
        self,
        entry: Entry,
        regions: Iterable[Region],
        table: np.ndarray | None,
        expected: int | None,
        mismatch: Callable[[int, int], str] | None,
        out: np.ndarray | None,
        reuse: bool,
        on_error: OnError | None,
        overlap: bool,
    ) -> Iterator[tuple[Region, np.ndarray]]:
        """The verified read loop every read of a whole tensor or shard goes through.

        Each region is read through the store, which checks every chunk it touches; with
        ``table`` (the regions are the store's chunks, in order), the digest is combined from
        the chunks' recorded CRCs, else computed over the words. ``overlap``: chunks are read
        unchecked and checked against the table in a worker thread while the next is read
        (crc32c releases the GIL); a chunk is yielded only once checked. Then the digest is
        compared with ``expected``."""
        reader = self._reader
        node = self._stored[entry.name].node
        fmt = entry.format
        pair = (2,) if fmt.words_per_value == 2 else ()
        scratch: list[np.ndarray | None] = [None, None]
        pool = self._checker() if overlap else None
        crc, whole = 0, True
        pending: tuple[Region, np.ndarray, Future[None]] | None = None

        def checked(item: tuple[Region, np.ndarray, Future[None]]) -> bool:
            try:
                item[2].result()  # IntegrityError before the chunk is handed out
            except CheckpointReplacedError:
                raise
            except CheckpointError as exc:
                if on_error is None:
                    raise
                on_error(item[0], exc)
                return False
            return True

        try:
            for i, region in enumerate(regions):
                selection = Selection.of_region(region)
                count = selection.count + pair
                into: np.ndarray | None = None
                if out is not None:
                    into = out[region]
                elif reuse:
                    n = math.prod(count)
                    k = i % 2 if pool is not None else 0  # two alternate while one is checked
                    buf = scratch[k]
                    if buf is None or buf.size < n:
                        buf = scratch[k] = np.empty(n, fmt.storage_dtype)
                    into = buf[:n].reshape(count)
                elif pool is not None:
                    into = np.empty(count, fmt.storage_dtype)
                try:
                    if pool is not None:
                        assert into is not None
                        words = reader.read_unchecked(node, selection, fmt, into)
                    else:
                        words = reader.read(node, selection, fmt, out=into)
                except CheckpointReplacedError:
                    raise
                except CheckpointError as exc:
                    if on_error is None:
                        raise
                    on_error(region, exc)
                    whole = False
                    continue
                if table is not None:  # the store checks this chunk against table[i]
                    crc = crc32c_combine(crc, int(table[i]), words.nbytes)
                elif expected is not None:
                    crc = crc32c_update(crc, words)
                if pool is None:
                    yield region, words
                    continue
                previous = pending
                pending = (region, words, pool.submit(reader.check_chunk, node, i, words))
                if previous is not None:
                    if checked(previous):
                        yield previous[0], previous[1]
                    else:
                        whole = False
            if pending is not None:
                last, pending = pending, None
                if checked(last):
                    yield last[0], last[1]
                else:
                    whole = False
        finally:
            if pending is not None:  # no buffer is reused while the worker still reads it
                pending[2].exception()
        if whole and expected is not None and crc != expected:
            reader.check_current()  # replaced while read: not damage
            assert mismatch is not None
            error = IntegrityError(mismatch(crc, expected))
            if on_error is None:
                raise error
            on_error(None, error)

    def _checker(self) -> ThreadPoolExecutor:
        with _CHECKER_LOCK:  # loads read tensors on two threads (read_ahead.py)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="lean_store-crc-read")
            return self._pool

    def close(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._reader.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (a DataLoader's workers under spawn or forkserver): opened again by path in
        the process that unpickles it, and refused there with CheckpointReplacedError if a
        newer save replaced the checkpoint meanwhile (its ``save_id`` differs), so a handle
        never reads another checkpoint than the one it was opened on."""
        if self._closed:
            raise CheckpointError(f"{self.path}: the checkpoint was closed; a closed handle "
                                  "cannot be pickled")
        if self._reopen_at is None:
            raise CheckpointError(
                f"a checkpoint opened from a {type(self.path).__name__} cannot be pickled (it "
                "cannot be opened again elsewhere): open it by its path")
        return (_reopened, (self._reopen_at, self.backend, self._storage_options,
                            self.root_attrs.get("save_id")))

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<lean_store.Checkpoint {self.backend} {str(self.path)!r} {len(self)} tensors>"


def _reopened(path: Any, backend: str, storage_options: dict[str, Any] | None,
              save_id: Any) -> Checkpoint:
    """A pickled :class:`Checkpoint`, opened again: the same checkpoint or none."""
    ck = Checkpoint(path, backend=backend, storage_options=storage_options)
    if save_id is not None and ck.root_attrs.get("save_id") != save_id:
        ck.close()
        raise CheckpointReplacedError(path, "after the handle was pickled; unpickled, it opened "
                                      "another save")
    return ck


def _handle_of(checkpoint: Checkpoint, name: str) -> TensorHandle:
    return checkpoint[name]


def _digest_mismatch(name: str, crc: int, recorded: int) -> str:
    return (f"tensor {name!r}: crc32c {crc:#010x} does not match the recorded "
            f"{recorded:#010x}; the checkpoint is corrupt")


def _worth_overlap(stored: StoredTensor, entry: Entry) -> bool:
    """Several chunks of at least OVERLAP_CRC_BYTES: checking one while reading the next pays."""
    chunk_bytes = math.prod(stored.chunk_shape) * entry.format.storage_dtype.itemsize
    return entry.nbytes > chunk_bytes >= OVERLAP_CRC_BYTES


def open(  # noqa: A001 - public API name
    path: Any, *, backend: str | None = None, storage_options: dict[str, Any] | None = None
) -> Checkpoint:
    """Open a checkpoint read-only: ``ck.layout``, ``ck[name][10:20]``, ``np.asarray(ck[name])``.
    ``storage_options``: fsspec options for a URL (endpoint, credentials)."""
    return Checkpoint(path, backend=backend, storage_options=storage_options)


# ---------------------------------------------------------------------------------- loading


@dataclass
class LoadResult:
    """What ``load`` did: names loaded, and names skipped under ``strict=False``."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def _casts(cast: Mapping[str, Any] | None) -> dict[str, ScalarFormat]:
    if cast is not None and not isinstance(cast, Mapping):
        raise CheckpointError(
            f"cast must map tensor names to formats (e.g. {{'fc.weight': 'float32'}}), got "
            f"{cast!r:.60}: lean_store casts only the tensors named, never the whole state")
    out = {}
    for name, fmt in (cast or {}).items():
        out[name] = get(fmt) if isinstance(fmt, str) else fmt
        if not isinstance(out[name], ScalarFormat):
            raise FormatError(f"cast for {name!r} must be a format or tag, got {fmt!r}")
    return out


def expected_with_casts(
    file_layout: Layout, target_layout: Layout, casts: dict[str, ScalarFormat]
) -> Layout:
    """The target layout, where each explicitly cast tensor expects the file's format."""
    problems = []
    specs = []
    for entry in target_layout:
        fmt = entry.format
        if entry.name in casts:
            if casts[entry.name] != fmt:
                problems.append(
                    Difference("format", entry.name, f"cast to {casts[entry.name].tag}", fmt.tag)
                )
            if entry.name in file_layout:
                fmt = file_layout[entry.name].format
        specs.append((entry.name, entry.shape, fmt))
    unknown = [n for n in casts if n not in target_layout]
    if unknown:
        raise CheckpointError(f"cast names tensors the target does not have: {unknown}")
    if problems:
        raise layout_error(problems, "cast request")
    return Layout.from_specs(specs)


def check_layout(stored: Layout, expected: Layout, **options: Any) -> None:
    """``stored.check(expected)``, the error ending with what to do where the differences
    are ones users meet with torch's own files: formats that a ``cast=`` converts on purpose
    (never done silently: a model kept in bfloat16 loaded from float32 weights would
    otherwise leave the user guessing), and BatchNorm counters old checkpoints lack."""
    diffs = stored.diff(expected, **options)
    if not diffs:
        return
    error = layout_error(diffs)
    hints = [hint for hint in (_cast_hint(diffs, expected), _counter_hint(diffs),
                               _prefix_hint(diffs)) if hint]
    if hints:
        raise LayoutError("\n".join([str(error), *hints]), diffs)
    raise error


def _cast_hint(diffs: list[Difference], expected: Layout) -> str | None:
    wanted = {d.name: expected[d.name].format.tag for d in diffs
              if d.kind == "format" and d.name is not None and d.name in expected}
    if not wanted:
        return None
    shown = dict(list(wanted.items())[:2])
    example = ", ".join(f"{n!r}: {t!r}" for n, t in shown.items())
    more = ", ..." if len(wanted) > len(shown) else ""
    return (f"Formats are never converted silently: to load "
            f"{'this tensor' if len(wanted) == 1 else f'these {len(wanted)} tensors'} converted "
            f"to the target's format, pass cast={{{example}{more}}} (name: format; the names "
            "are in this error's .differences, kind 'format')")


def _prefix_hint(diffs: list[Difference]) -> str | None:
    """When every missing name is an unexpected one with a common start in front (the
    checkpoint of a module that held the target, a LightningModule's ``model.``), or the other
    way round (the target holds the checkpoint's module): say which."""
    missing = [d.name for d in diffs if d.kind == "missing" and d.name is not None]
    extra = [d.name for d in diffs if d.kind == "extra" and d.name is not None]
    for short, long, hint in (
            (missing, extra, "The checkpoint's names are the target's with {p!r} in front (a "
             "module saved inside another, e.g. a LightningModule's self.model): load with "
             "prefix={p!r}"),
            (extra, missing, "The target's names are the checkpoint's with {p!r} in front: "
             "load into that submodule of the target")):
        if not short or not long:
            continue
        first = short[0]
        starts = {name[: -len(first)] for name in long if name.endswith(first) and name != first}
        held = set(long)
        for start in sorted(starts, key=len):
            if all(start + name in held for name in short):
                return hint.format(p=start)
    return None


COUNTER = "num_batches_tracked"


def _counter_hint(diffs: list[Difference]) -> str | None:
    missing = [d.name for d in diffs if d.kind == "missing"]
    if not missing or not all(n is not None and n.rsplit(".", 1)[-1] == COUNTER
                              for n in missing):
        return None
    return (f"The missing tensors are BatchNorm counters ({COUNTER}), which checkpoints "
            "written before torch 0.4.1 and files converted from them lack (torch's "
            "load_state_dict sets them to 0 for such files): load with strict=False to load "
            "the rest, each counter keeping its value (0 in a new model)")


def checkpoint_spelling(names: list[str], stored: Layout, prefix: str, module: bool
                    ) -> dict[str, str]:
    """A target's ``names`` -> how the checkpoint (layout ``stored``) spells them, where it
    differs: ``prefix`` in front of each, or else, for a module, without what wrappers add
    (:func:`~lean_store.sources.module_names.spelled_as`)."""
    if prefix:
        return {name: prefix + name for name in names}
    return spelled_as(names, stored.names()) if module else {}


def under_prefix(layout: Layout, prefix: str) -> Layout:
    """The entries of ``layout`` whose names start with ``prefix`` (all of it for ``""``): what
    a load with ``prefix`` reads, the rest of the checkpoint being no concern of its target."""
    if not isinstance(prefix, str):
        raise CheckpointError(f"prefix must be a string, got {prefix!r}")
    if not prefix:
        return layout
    names = [n for n in layout.names() if n.startswith(prefix)]
    if not names:
        shown = ", ".join(map(repr, layout.names()[:3]))
        raise CheckpointError(f"the checkpoint holds no tensor whose name starts with "
                              f"{prefix!r} (its names are like {shown})")
    return layout.subset(names)


def _read_all(ck: Checkpoint, names: list[str], read: Callable[[str], T]) -> dict[str, T]:
    """``{name: read(name)}``: a tensor read, checked and decompressed while the next one is
    (:mod:`lean_store.read_ahead`); a remote store's reads stay on this thread."""
    if is_url(ck.path):
        return {name: read(name) for name in names}
    return read_all(names, read, sizes=[ck.layout[n].nbytes for n in names])


def _convert(words: np.ndarray, src: ScalarFormat, dst: ScalarFormat) -> np.ndarray:
    if src is dst or src == dst:  # standard formats are one object each: no field compare
        return words
    return dst.encode(src.decode(words))


def load(
    target: Any,
    path: Any,
    *,
    strict: bool = True,
    cast: Mapping[str, Any] | None = None,
    verify: bool = True,
    progress: Any = None,
    strict_order: bool = False,
    storage_options: dict[str, Any] | None = None,
    prefix: str = "",
) -> LoadResult:
    """The single-process load behind :func:`lean_store.load`, whose docstring is the
    contract (validated first, every checksum checked with ``verify``, the target unchanged on
    any error, no silent cast, tensors matched by name). Sharded loads (a ``process_group``,
    or DTensors / ``LocalShard`` values) go to :mod:`lean_store.distributed` instead.
    """
    casts = _casts(cast)
    given = tensor_targets(target)
    touched: list[bool] = []  # set once anything was copied into the target

    def load_from(ck: Checkpoint) -> LoadResult:
        stored = under_prefix(ck.layout, prefix)
        spelling = checkpoint_spelling(list(given), ck.layout, prefix, is_module(target))
        targets = respelled(given, spelling)
        # extra state and lazy parameters as saved; tied names through the twin the file holds
        targets, tied = fitted_to_stored(targets, stored)
        target_layout = Layout.from_specs(
            [(n, t.entry.shape, t.entry.format) for n, t in targets.items()])
        expected = expected_with_casts(stored, target_layout, respelled(casts, spelling))
        check_layout(stored, expected, allow_missing=not strict, allow_extra=not strict,
                     order_matters=strict_order)
        result = LoadResult(
            missing=[n for n in expected.names() if n not in stored],
            unexpected=[n for n in stored.names() if n not in expected],
        )
        names = [n for n in expected.names() if n in stored]
        kept: dict[str, tuple[Region, np.ndarray]] = {}
        if verify:  # every chunk and digest checked before the target changes at all
            room, keep = KEPT_VERIFIED_BYTES, []
            for name in names:
                nbytes = ck.layout[name].nbytes
                if nbytes <= room:  # checked words kept for the install: no second read
                    keep.append(name)
                    room -= nbytes
            kept = _read_all(ck, keep, ck.verified_words)
            ck.verify([name for name in names if name not in kept])
        else:  # each tensor's own metadata, and the chunk-file lengths the store checks on a
            # read rather than on open (Zarr: a one-chunk array's file), before any install
            for name in names:
                ck.check_metadata(name)
        total = sum(ck.layout[n].nbytes for n in names)
        # meta tensors get memory now (all or none), taken back if nothing gets installed
        with prepared([targets[n] for n in names], lambda: bool(touched)), \
                make_progress(progress, f"load {Path(str(path)).name}", total) as bar:
            for name in names:
                try:
                    words = kept.pop(name, None)
                    if words is not None:
                        _install_words(ck.layout[name], targets[name], words, bar, touched)
                    else:
                        _install(ck, ck.layout[name], targets[name], bar, touched)
                except CheckpointReplacedError:
                    if touched:
                        raise CheckpointReplacedError(
                            path, "while copied into the target, which now holds part of it; "
                            "load again") from None
                    raise
                result.loaded.append(name)
        for name in names:  # a module's extra state, handed to it (sources/module_state.py)
            targets[name].finish()
        result.loaded.extend(n for n, twin in tied.items() if twin in result.loaded)
        return result

    result = read_once(path, load_from, lambda: not touched, storage_options=storage_options)
    warn_skipped(result)
    after_load(target, given.values(), stacklevel=3)
    return result


def is_module(obj: Any) -> bool:
    """A torch module (what :mod:`.sources.module_names` renames), not a state dict."""
    return callable(getattr(obj, "state_dict", None)) and not isinstance(obj, Mapping)


def respelled_layout(layout: Layout, spelling: Mapping[str, str]) -> Layout:
    """``layout`` with each name ``spelling`` names spelled so: a module's tensors are named
    without what wrappers add (torch.compile's ``_orig_mod``, DDP's ``module.``), and a
    checkpoint saved from a wrapped module before lean_store left that out stores them with
    it (sources/module_names.py)."""
    if not spelling:
        return layout
    return Layout.from_specs([(spelling.get(e.name, e.name), e.shape, e.format) for e in layout])


def warn_skipped(result: LoadResult) -> None:
    """Say which names ``strict=False`` skipped, if any."""
    if result.missing or result.unexpected:
        warnings.warn(
            f"strict=False: skipped {len(result.missing)} tensors missing from the checkpoint "
            f"{result.missing} and {len(result.unexpected)} unexpected ones {result.unexpected}",
            stacklevel=3,
        )


def read_once(
    path: Any, read: Callable[[Checkpoint], T], may_retry: Callable[[], bool] = lambda: True,
    *, storage_options: dict[str, Any] | None = None,
) -> T:
    """``read(ck)`` on the checkpoint at ``path``; started over on the new checkpoint (up to
    OPEN_ATTEMPTS times, while ``may_retry()``) when a save replaces it before ``read`` is
    done, so that everything returned comes from one checkpoint. Python's cyclic collector is
    paused meanwhile (:mod:`.gc_pause`)."""
    for attempt in range(OPEN_ATTEMPTS):
        try:
            with collection_paused(), Checkpoint(path, storage_options=storage_options) as ck:
                return read(ck)
        except CheckpointReplacedError:
            if attempt == OPEN_ATTEMPTS - 1 or not may_retry():
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _install_words(entry: Entry, target: TargetTensor, kept: tuple[Region, np.ndarray],
                   bar: Any, touched: list[bool]) -> None:
    """Install the whole tensor's words, checked already (:meth:`Checkpoint.verified_words`)."""
    region, words = kept
    if not touched:
        touched.append(True)
    target.write(region, _convert(words, entry.format, target.entry.format))
    bar.advance(words.nbytes)


def _install(
    ck: Checkpoint, entry: Entry, target: TargetTensor, bar: Any, touched: list[bool]
) -> None:
    src, dst = entry.format, target.entry.format
    for region, words in ck.blocks(entry.name, reuse=True):
        if not touched:
            touched.append(True)
        target.write(region, _convert(words, src, dst))
        bar.advance(words.nbytes)


def load_state(
    path: Any,
    *,
    like: Any = None,
    cast: Mapping[str, Any] | None = None,
    strict: bool = True,
    strict_order: bool = False,
    storage_options: dict[str, Any] | None = None,
    prefix: str = "",
) -> dict[str, Any]:
    """Read a checkpoint into a NEW dict; nothing is mutated.

    Without ``like``: numpy arrays (ml_dtypes dtypes where they exist) and ``Encoded`` values.
    With ``like`` (a module, state dict or Layout): validated against it, and returned as torch
    tensors of the same dtypes on the same devices when ``like`` holds torch tensors, matched
    by name (``strict_order=True`` also requires ``like``'s order). With ``prefix``: only the
    tensors whose names start with it, named without it (a module saved inside another, such
    as a LightningModule's ``model.``).
    """
    casts = _casts(cast)
    return read_once(
        path, lambda ck: _state_of(ck, like, casts, strict, strict_order, prefix),
        storage_options=storage_options,
    )


def _state_of(
    ck: Checkpoint, like: Any, casts: dict[str, ScalarFormat], strict: bool, strict_order: bool,
    prefix: str = "",
) -> dict[str, Any]:
    stored = under_prefix(ck.layout, prefix)
    likes: dict[str, Any] = {}  # like's torch tensors
    own_names: dict[str, str] = {}  # a stored spelling -> the name ``like`` gives it
    if like is not None:
        like_layout = template_layout(like)  # meta tensors: templates
        extra = _extra_state_names(like, like_layout)
        likes = _torch_values_of(like)
        spelling = checkpoint_spelling(like_layout.names(), ck.layout, prefix, is_module(like))
        like_layout = respelled_layout(like_layout, spelling)
        if extra:  # a module's extra state as it was saved (sources/module_state.py)
            like_layout = _stored_extra_state(like_layout, {spelling.get(n, n) for n in extra},
                                              stored)
        likes = respelled(likes, spelling)
        casts = respelled(casts, spelling)
        own_names = {stored: name for name, stored in spelling.items()}
        expected = expected_with_casts(stored, like_layout, casts)
        check_layout(stored, expected, allow_missing=not strict, allow_extra=not strict,
                     order_matters=strict_order)
        wanted = {e.name: like_layout[e.name].format for e in expected if e.name in stored}
    else:
        casts = {prefix + n: f for n, f in casts.items()}
        if any(n not in stored for n in casts):
            raise CheckpointError(f"cast names tensors the checkpoint lacks: "
                                  f"{[n[len(prefix):] for n in casts if n not in stored]}")
        wanted = {e.name: casts.get(e.name, e.format) for e in stored}
        own_names = {n: n[len(prefix):] for n in wanted} if prefix else {}
    def words_of(name: str) -> np.ndarray:
        return _convert(ck.read_bits(name), ck.layout[name].format, wanted[name])

    read = _read_all(ck, list(wanted), words_of)
    out: dict[str, Any] = {}
    for name, fmt in wanted.items():
        entry = ck.layout[name]
        words = read.pop(name)
        if name in likes:  # a tensor like like's: its device (and a packed FP4 dtype)
            from .sources.torch_source import new_tensor_like

            out[name] = new_tensor_like(words, fmt, entry.shape, likes[name])
        else:
            out[name] = as_values(words, fmt)
    return respelled(out, own_names) if own_names else out


def _extra_state_names(like: Any, layout: Layout) -> set[str]:
    """The entries of ``layout`` (``like``'s) that are a module's extra state."""
    if not is_module(like):
        return set()
    from .sources.torch_source import extra_state_names

    return extra_state_names(like, layout)


def _stored_extra_state(layout: Layout, names: set[str], stored: Layout) -> Layout:
    """``layout`` with the stored shape and format of each extra-state entry (``names``) the
    checkpoint holds: extra state is returned as it was saved, as torch would hand it to
    ``set_extra_state``."""
    if not any(n in stored for n in names):
        return layout
    return Layout.from_specs([
        (e.name, stored[e.name].shape, stored[e.name].format)
        if e.name in names and e.name in stored else (e.name, e.shape, e.format)
        for e in layout])


def _torch_values_of(like: Any) -> dict[str, Any]:
    if isinstance(like, Layout):
        return {}
    from .sources import is_torch_state

    if not is_torch_state(like):
        return {}
    from .sources.torch_source import state_dict_of

    return {name: value for name, value in state_dict_of(like).items()
            if hasattr(value, "device")}


__all__ = ["Checkpoint", "LoadResult", "OnError", "TensorHandle", "load", "load_state", "open"]
