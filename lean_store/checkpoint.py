"""Reading: ``open`` (a validated ``Checkpoint``), ``load`` (single process, in place) and
``load_state``: store -> validate -> stream -> target. Saving lives in :mod:`lean_store.api`
(the API layer) and :mod:`lean_store.writing` (the save pipeline)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .chunking import (
    DEFAULT_CHUNK_BYTES,
    iter_regions,
    plan_chunks,
    splits_into_row_blocks,
    stored_rank_shape,
)
from .encoded import Encoded
from .errors import CheckpointError, CheckpointReplacedError, FormatError, IntegrityError
from .formats import ScalarFormat, get
from .indexing import basic_index
from .integrity import crc32c_combine, crc32c_update
from .layout import Difference, Entry, Layout, layout_error
from .metadata import check_stored, parse_root
from .progress import make_progress
from .sources import TargetTensor, tensor_targets
from .stores.base import Selection, StoredTensor
from .stores.registry import open_reader
from .writing import OVERLAP_CRC_BYTES

OPEN_ATTEMPTS = 3
"""Times ``open``, ``load`` and ``load_state`` start over when a save replaces the checkpoint
while they read it."""
T = TypeVar("T")


# ---------------------------------------------------------------------------------- reading


class TensorHandle:
    """One stored tensor: metadata now, data on demand (only the chunks a slice touches)."""

    def __init__(self, checkpoint: Checkpoint, entry: Entry, stored: StoredTensor) -> None:
        self._ck = checkpoint
        self.entry = entry
        self.stored = stored

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
        """Raw words of ``self[key]`` (complex formats: trailing axis of 2)."""
        index = basic_index(key, self.shape)
        words = self._ck._reader.read(self.stored.node, index.selection, self.format)
        return index.finish(words, self.format.words_per_value == 2)

    def __getitem__(self, key: Any) -> np.ndarray | Encoded:
        return as_values(self.bits(key), self.format)

    def read(self) -> np.ndarray | Encoded:
        """The whole tensor, with its crc32c digest verified."""
        return as_values(self._ck._read_verified(self.entry), self.format)

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


def as_values(words: np.ndarray, fmt: ScalarFormat) -> np.ndarray | Encoded:
    """Words as a numpy array of the format's dtype, or ``Encoded`` where none exists."""
    dtype = fmt.numpy_dtype
    if dtype is None:
        return Encoded(words, fmt)
    if fmt.words_per_value == 2:
        return np.ascontiguousarray(words).view(dtype).reshape(words.shape[:-1])
    return words.view(dtype)


class Checkpoint(Mapping[str, TensorHandle]):
    """A read-only, validated view of a checkpoint. Use as a context manager."""

    def __init__(self, path: Any, *, backend: str | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.path = path
        self._pool: ThreadPoolExecutor | None = None  # checks chunks while reading ahead
        for attempt in range(OPEN_ATTEMPTS):  # a save replaced the path while it was opened
            try:
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
            from .distributed.sharded_read import stored_shards

            self._shards = stored_shards(self)  # {} unless saved by lean_store.distributed
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
        if name not in self.layout:
            raise KeyError(name)
        return TensorHandle(self, self.layout[name], self._stored[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names())

    def __len__(self) -> int:
        return len(self.layout)

    def _read_units(self, entry: Entry) -> Iterator[tuple[Any, Selection]]:
        shape = stored_rank_shape(entry)
        chunks = self._stored[entry.name].chunk_shape[: len(shape)]
        if not splits_into_row_blocks(shape, chunks):
            chunks = plan_chunks(shape, entry.format.storage_dtype.itemsize, DEFAULT_CHUNK_BYTES)
        for region in iter_regions(shape, chunks):
            yield region, Selection.of_region(region)

    def iter_bits(
        self, entry: Entry, out: np.ndarray | None = None, *, reuse: bool = False
    ) -> Iterator[tuple[Any, np.ndarray]]:
        """Raw words region by region in C order; the digest is checked after the last one.
        A sharded tensor comes shard by shard instead, each shard's digest checked.
        ``out`` (stored shape, storage dtype): each region is read straight into it.
        ``reuse``: every region is read into one scratch buffer, valid until the next region
        (no allocation, no fresh pages per region).

        Where the store checks every chunk against a per-chunk CRC table (HDF5) and the regions
        are its chunks, the digest is derived from the table (no second pass over the data)."""
        if self._shards.get(entry.name):
            from .distributed.sharded_read import iter_sharded_bits

            for region, words in iter_sharded_bits(self, entry, self._shards[entry.name]):
                if out is not None:
                    out[region] = words
                yield region, words
            return
        node = self._stored[entry.name].node
        expected = self._stored[entry.name].attrs.get("crc32c")
        table = self._reader.chunk_crcs(node) if self._units_are_chunks(entry) else None
        crc = 0
        scratch: np.ndarray | None = None
        pair = (2,) if entry.format.words_per_value == 2 else ()
        if table is not None and hasattr(self._reader, "check_chunk") and _worth_overlap(
            self._stored[entry.name], entry
        ):
            crc = yield from self._iter_checked_ahead(entry, node, table, out, reuse)
            units: Any = ()
        else:
            units = self._read_units(entry)
        for i, (region, selection) in enumerate(units):
            into = None if out is None else out[region]
            if into is None and reuse:
                n = math.prod(selection.count + pair)
                if scratch is None or scratch.size < n:
                    scratch = np.empty(n, entry.format.storage_dtype)
                into = scratch[:n].reshape(selection.count + pair)
            words = self._reader.read(node, selection, entry.format, out=into)
            if table is not None:  # the reader checked this chunk against table[i]
                crc = crc32c_combine(crc, int(table[i]), words.nbytes)
            else:
                crc = crc32c_update(crc, words)
            yield region, words
        if expected is not None and crc != expected:
            self._reader.check_current()  # replaced while read: not damage
            raise IntegrityError(
                f"tensor {entry.name!r}: crc32c {crc:#010x} does not match the recorded "
                f"{expected:#010x}; the checkpoint is corrupt"
            )

    def _iter_checked_ahead(
        self, entry: Entry, node: str, table: np.ndarray, out: np.ndarray | None, reuse: bool
    ) -> Generator[tuple[Any, np.ndarray], None, int]:
        """Chunk by chunk, each checked against the CRC table in a worker thread while the next
        chunk is read (crc32c releases the GIL); a chunk is yielded only once checked. With
        ``reuse``, two scratch buffers alternate. Returns the digest derived from the table."""
        reader: Any = self._reader
        pair = (2,) if entry.format.words_per_value == 2 else ()
        scratch: list[np.ndarray | None] = [None, None]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lean_store-crc-read")
        crc = 0
        pending: tuple[Any, np.ndarray, Any] | None = None
        try:
            for i, (region, selection) in enumerate(self._read_units(entry)):
                shape = selection.count + pair
                if out is not None:
                    into = out[region]
                elif reuse:
                    n = math.prod(shape)
                    buf = scratch[i % 2]
                    if buf is None or buf.size < n:
                        buf = scratch[i % 2] = np.empty(n, entry.format.storage_dtype)
                    into = buf[:n].reshape(shape)
                else:
                    into = np.empty(shape, entry.format.storage_dtype)
                words = reader.read_unchecked(node, selection, entry.format, into)
                previous = pending
                pending = (region, words, self._pool.submit(reader.check_chunk, node, i, words))
                crc = crc32c_combine(crc, int(table[i]), words.nbytes)
                if previous is not None:
                    previous[2].result()  # IntegrityError before the chunk is handed out
                    yield previous[0], previous[1]
            if pending is not None:
                pending[2].result()
                yield pending[0], pending[1]
                pending = None
        finally:
            if pending is not None:  # no buffer is reused while the worker still reads it
                pending[2].exception()
        return crc

    def _units_are_chunks(self, entry: Entry) -> bool:
        shape = stored_rank_shape(entry)
        chunks = self._stored[entry.name].chunk_shape
        return len(chunks) == len(shape) and splits_into_row_blocks(shape, chunks)

    def _read_verified(self, entry: Entry) -> np.ndarray:
        shape = stored_rank_shape(entry)
        pair = (2,) if entry.format.words_per_value == 2 else ()
        out = np.empty(shape + pair, dtype=entry.format.storage_dtype)
        with self._reader.checks_deferred():  # ``out`` is handed out only at the end
            for _ in self.iter_bits(entry, out=out):  # each region is read in place
                pass
        return out.reshape(entry.shape + pair)

    def verify(self) -> None:
        """Read every tensor and check every chunk checksum and digest."""
        check_metadata = getattr(self._reader, "check_metadata", None)  # Zarr: own zarr.json
        for entry in self.layout:
            if check_metadata is not None:
                check_metadata(self._stored[entry.name].node)
            with self._reader.checks_deferred():
                for _ in self.iter_bits(entry, reuse=True):
                    pass

    def to_dask(self, name: str, *, decode: bool | None = None) -> Any:
        """A lazy dask array of tensor ``name``, chunked like the store (see ``analysis``)."""
        from .inspection.analysis import to_dask

        return to_dask(self, name, decode=decode)

    def to_xarray(self) -> Any:
        """An ``xarray.Dataset`` of every tensor as lazy dask variables (see ``analysis``)."""
        from .inspection.analysis import to_xarray

        return to_xarray(self)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._reader.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<lean_store.Checkpoint {self.backend} {str(self.path)!r} {len(self)} tensors>"


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


def _convert(words: np.ndarray, src: ScalarFormat, dst: ScalarFormat) -> np.ndarray:
    if src == dst:
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
) -> LoadResult:
    """Load a checkpoint in place into a torch module, a state dict, or a dict of arrays.

    The whole checkpoint is validated first (header, count, names, shapes, formats, widths,
    payload lengths) and, with ``verify=True``, every checksum is checked too. Only then is
    anything copied in; on any error the target is unchanged. There is never a silent cast:
    pass ``cast={"name": "float32"}`` to convert a tensor explicitly.
    Tensors are matched by name, so a file whose tensors are in another order (a converted
    safetensors file is sorted by name) loads; ``strict_order=True`` also requires the file's
    tensors to be in the target's order.
    This is the single-process load; :func:`lean_store.load` (the API layer) sends sharded
    loads (a ``process_group``, or DTensors / ``LocalShard`` values) to
    :mod:`lean_store.distributed` instead.
    """
    casts = _casts(cast)
    targets = tensor_targets(target)
    target_layout = Layout.from_specs(
        [(n, t.entry.shape, t.entry.format) for n, t in targets.items()]
    )
    touched: list[bool] = []  # set once anything was copied into the target

    def load_from(ck: Checkpoint) -> LoadResult:
        expected = expected_with_casts(ck.layout, target_layout, casts)
        ck.layout.check(expected, allow_missing=not strict, allow_extra=not strict,
                        order_matters=strict_order)
        result = LoadResult(
            missing=[n for n in expected.names() if n not in ck.layout],
            unexpected=[n for n in ck.layout.names() if n not in expected],
        )
        names = [n for n in expected.names() if n in ck.layout]
        if verify:  # every chunk and digest checked before the target changes at all
            for name in names:
                with ck._reader.checks_deferred():
                    for _ in ck.iter_bits(ck.layout[name], reuse=True):
                        pass
        total = sum(ck.layout[n].nbytes for n in names)
        with make_progress(progress, f"load {Path(str(path)).name}", total) as bar:
            for name in names:
                try:
                    _install(ck, ck.layout[name], targets[name], bar, touched)
                except CheckpointReplacedError:
                    if touched:
                        raise CheckpointReplacedError(
                            path, "while copied into the target, which now holds part of it; "
                            "load again") from None
                    raise
                result.loaded.append(name)
        return result

    result = read_once(path, load_from, lambda: not touched, storage_options=storage_options)
    warn_skipped(result)
    return result


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
    done, so that everything returned comes from one checkpoint."""
    for attempt in range(OPEN_ATTEMPTS):
        try:
            with Checkpoint(path, storage_options=storage_options) as ck:
                return read(ck)
        except CheckpointReplacedError:
            if attempt == OPEN_ATTEMPTS - 1 or not may_retry():
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _install(
    ck: Checkpoint, entry: Entry, target: TargetTensor, bar: Any, touched: list[bool]
) -> None:
    src, dst = entry.format, target.entry.format
    for region, words in ck.iter_bits(entry, reuse=True):
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
) -> dict[str, Any]:
    """Read a checkpoint into a NEW dict; nothing is mutated.

    Without ``like``: numpy arrays (ml_dtypes dtypes where they exist) and ``Encoded`` values.
    With ``like`` (a module, state dict or Layout): validated against it, and returned as torch
    tensors of the same dtypes on the same devices when ``like`` holds torch tensors, matched
    by name (``strict_order=True`` also requires ``like``'s order).
    """
    casts = _casts(cast)
    return read_once(
        path, lambda ck: _state_of(ck, like, casts, strict, strict_order),
        storage_options=storage_options,
    )


def _state_of(
    ck: Checkpoint, like: Any, casts: dict[str, ScalarFormat], strict: bool, strict_order: bool
) -> dict[str, Any]:
    devices: dict[str, Any] = {}
    if like is not None:
        like_layout = Layout.of(like)
        devices = _devices_of(like)
        expected = expected_with_casts(ck.layout, like_layout, casts)
        ck.layout.check(expected, allow_missing=not strict, allow_extra=not strict,
                        order_matters=strict_order)
        wanted = {e.name: like_layout[e.name].format for e in expected if e.name in ck.layout}
    else:
        if any(n not in ck.layout for n in casts):
            raise CheckpointError(f"cast names tensors the checkpoint lacks: {list(casts)}")
        wanted = {e.name: casts.get(e.name, e.format) for e in ck.layout}
    out: dict[str, Any] = {}
    for name, fmt in wanted.items():
        entry = ck.layout[name]
        words = _convert(ck._read_verified(entry), entry.format, fmt)
        if name in devices:
            from .sources.torch_source import new_tensor

            out[name] = new_tensor(words, fmt, entry.shape, devices[name])
        else:
            out[name] = as_values(words, fmt)
    return out


def _devices_of(like: Any) -> dict[str, Any]:
    if isinstance(like, Layout):
        return {}
    from .sources import is_torch_state

    if not is_torch_state(like):
        return {}
    from .sources.torch_source import state_dict_of

    return {
        name: value.device
        for name, value in state_dict_of(like).items()
        if hasattr(value, "device")
    }


__all__ = ["Checkpoint", "LoadResult", "TensorHandle", "load", "load_state", "open"]
