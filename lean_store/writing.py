"""The save pipeline: a source's tensors, one write unit at a time, into a store writer."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .chunking import iter_regions
from .integrity import crc32c_combine, crc32c_of, crc_workers, forget_crc_workers
from .layout import Entry, Layout, stored_rank_shape
from .metadata import format_attrs, root_attrs
from .naming import check_names
from .options import SaveOptions, merge_options
from .progress import NullProgress, make_progress
from .sources import TensorSource
from .stores.registry import backend_for, backend_record, open_writer
from .stream import staged

OVERLAP_CRC_BYTES = 1 << 20
"""Write units at least this large have their CRC-32C computed in a thread while written."""

def _crc_pool() -> ThreadPoolExecutor:
    """The CRC workers every save shares (:func:`lean_store.integrity.crc_workers`)."""
    return crc_workers()


def _forget_crc_pool() -> None:
    """In a forked child the parent's worker threads do not exist: start afresh."""
    forget_crc_workers()


def write_source(
    source: TensorSource,
    path: str | os.PathLike,
    *,
    kind: str,
    backend: str | None = None,
    options: SaveOptions | None = None,
    extra_root: dict[str, Any] | None = None,
    chunk_bytes: int | None = None,
    compression: Any = None,
    progress: Any = None,
    buffer_bytes: int | None = None,
    checksum: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Layout:
    """Stream every tensor of ``source`` into a new checkpoint, committed atomically.

    One write unit at a time: host tensors as zero-copy views, device tensors through the
    pooled host buffers of :func:`lean_store.stream.staged` (at most ``buffer_bytes``, default
    64 MiB, or one write unit if that is larger), copied ahead while the store writes.
    The save options come as ``options`` or as keywords (see :class:`SaveOptions`);
    ``snapshot`` does not apply here (nothing is copied first).
    """
    opts = merge_options(options, chunk_bytes=chunk_bytes, compression=compression,
                         progress=progress, buffer_bytes=buffer_bytes, checksum=checksum,
                         storage_options=storage_options)
    chunk_bytes, compression, progress = opts.chunk_bytes, opts.compression, opts.progress
    buffer_bytes, checksum, storage_options = opts.buffer_bytes, opts.checksum, \
        opts.storage_options
    layout = source.layout
    check_names(layout.names())
    backend = backend_for(path, backend)
    writer = open_writer(path, backend, chunk_bytes=chunk_bytes, compression=compression,
                         checksum=checksum, storage_options=storage_options)
    attrs_of = _AttrsOfSave(backend_record(backend).storage_name)

    def units() -> Iterator[tuple[Any, Any, Any]]:
        """``(key, tensor, region)`` per write unit, ``key`` being ``(sink, stable, last)``:
        ``last`` marks a tensor's final unit (the marker item ``(key, None, None)`` of a
        tensor with no units), so one-unit tensors pass the pipeline as one item."""
        for entry, tensor in source.tensors():
            sink = writer.add_tensor(entry, attrs_of(entry))
            # a host tensor whose reads stay valid may have its units written behind
            stable = getattr(tensor, "stable_reads", False) and \
                getattr(tensor, "stage_engine", None) is None
            regions = iter_regions(stored_rank_shape(entry), sink.write_unit)
            region = next(regions, None)
            if region is None:  # nothing to write: the tensor's end alone
                yield (sink, stable, True), None, None
                continue
            key = (sink, stable, False)
            for following in regions:
                yield key, tensor, region
                region = following
            yield (sink, stable, True), tensor, region

    crc_pool = _crc_pool()
    submit = _submitter(crc_pool)  # for units written behind
    with writer, make_progress(progress, f"save {Path(path).name}", layout.nbytes) as bar:
        order = _InOrder()
        counting = type(bar) is not NullProgress  # no call per unit without a bar
        try:
            for (sink, stable, last), region, bits in staged(units(),
                                                             buffer_bytes=buffer_bytes):
                if bits is None:
                    order.end(sink)
                    continue
                nbytes = bits.nbytes
                if counting:
                    bar.advance(nbytes)
                # units of host memory: the file written and its CRC-32C computed on a
                # worker while the next units are prepared (and written, on the other worker)
                later = None
                if stable and nbytes >= OVERLAP_CRC_BYTES:
                    order.make_room(nbytes)
                    later = sink.write_later(region, bits, submit)
                elif stable and sink.small_later:  # a small unit: its bytes queued
                    later = crc32c_of(bits)
                    if not sink.write_small_later(region, bits, later, submit):
                        sink.write(region, bits, later)
                if later is not None:
                    order.unit(sink, later, nbytes)
                else:
                    order.unit(sink, _write_unit(crc_pool, sink, region, bits), nbytes)
                if last:
                    order.end(sink)
            order.settle()
        except BaseException:
            order.abandon()  # no worker still writing into the store being removed
            raise
        writer.commit(root_attrs(layout, kind, extra_root))
    return layout


class _AttrsOfSave:
    """The attributes of each tensor of one save (:func:`lean_store.metadata.tensor_attrs`),
    the part that depends only on the format (format tag, width, parameters, storage name)
    built once per format of the save."""

    def __init__(self, storage_name: Callable[[Any], str]) -> None:
        self._storage_name = storage_name
        self._tails: dict[Any, dict[str, Any]] = {}

    def __call__(self, entry: Entry) -> dict[str, Any]:
        fmt = entry.format
        tail = self._tails.get(fmt)
        if tail is None:
            tail = self._tails[fmt] = format_attrs(fmt, self._storage_name(fmt))
        attrs = {"index": entry.index, "name": entry.name, "shape": tuple(entry.shape)}
        attrs.update(tail)
        return attrs


WRITE_BEHIND_BYTES = 32 << 20
"""Bytes of units written behind (on the workers, see :meth:`TensorWriter.write_later`) at
once; two units at least, so that both workers write. A host tensor's units are views of its
memory: this bounds only the copies of units that are not (non-contiguous sources)."""


def _write_unit(crc_pool: ThreadPoolExecutor, sink: Any, region: Any, bits: Any) -> int:
    """Write one unit in order; its CRC-32C (computed in one pass, combined into the
    tensor's digest): units of 1 MiB or more have it computed on another core while the store
    writes them (crc32c releases the GIL). Returns once ``bits`` is no longer read."""
    pending = None
    if bits.nbytes >= OVERLAP_CRC_BYTES:
        try:
            pending = crc_pool.submit(crc32c_of, bits)
        except RuntimeError:  # pools refuse work once interpreter shutdown has begun
            pass
    if pending is not None:
        try:
            sink.write(region, bits, pending.result)
        finally:  # the CRC reads ``bits``: done before its buffer can be reused
            unit_crc = pending.result()
        return unit_crc
    unit_crc = crc32c_of(bits)
    sink.write(region, bits, unit_crc)
    return unit_crc


def _submitter(pool: ThreadPoolExecutor) -> Callable[..., Future[Any]]:
    """``pool.submit``, or (once interpreter shutdown has begun) running the call here."""

    def submit(fn: Callable[..., Any], *args: Any) -> Future[Any]:
        try:
            return pool.submit(fn, *args)
        except RuntimeError:
            done: Future[Any] = Future()
            try:
                done.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 - handed to the caller as the result
                done.set_exception(exc)
            return done

    return submit


class _InOrder:
    """The units of a save in order, some still being written behind: each unit's CRC-32C is
    combined into its tensor's digest, and each tensor closed, in save order, once the units
    before are done."""

    def __init__(self) -> None:
        # (sink, the unit's CRC-32C or its future, its bytes); (sink, None, 0): a tensor's end
        self._queue: deque[tuple[Any, int | Future[int] | None, int]] = deque()
        self._behind = 0  # bytes of the queued futures
        self._futures = 0
        self._crc = 0  # digest so far of the tensor at the head

    def unit(self, sink: Any, crc: int | Future[int], nbytes: int) -> None:
        if not self._queue and type(crc) is int:  # written in order, nothing behind it
            self._crc = crc32c_combine(self._crc, crc, nbytes)
            return
        if isinstance(crc, Future):
            self._behind += nbytes
            self._futures += 1
        self._queue.append((sink, crc, nbytes))
        self._advance(wait=False)

    def end(self, sink: Any) -> None:
        if not self._queue:  # every unit of the tensor is done: close it now
            crc, self._crc = self._crc, 0
            sink.close({"crc32c": crc})
            return
        self._queue.append((sink, None, 0))
        self._advance(wait=False)

    def make_room(self, nbytes: int) -> None:
        """Wait until a unit of ``nbytes`` fits in :data:`WRITE_BEHIND_BYTES`."""
        while self._futures >= 2 and self._behind + nbytes > WRITE_BEHIND_BYTES:
            self._advance(wait=True, one=True)

    def settle(self) -> None:
        """Every unit written, every tensor closed."""
        while self._queue:
            self._advance(wait=True)

    def _advance(self, *, wait: bool, one: bool = False) -> None:
        """Handle the units at the head that are done (waiting for them when ``wait``;
        ``one``: stop after the first future)."""
        while self._queue:
            sink, crc, nbytes = self._queue[0]
            if isinstance(crc, Future):
                if not wait and not crc.done():
                    return
                value = crc.result()
                self._behind -= nbytes
                self._futures -= 1
                self._queue.popleft()
                self._crc = crc32c_combine(self._crc, value, nbytes)
                if one:
                    return
                continue
            self._queue.popleft()
            if crc is None:
                sink.close({"crc32c": self._crc})
                self._crc = 0
            else:
                self._crc = crc32c_combine(self._crc, crc, nbytes)

    def abandon(self) -> None:
        """After an error: wait for the units still being written (their errors dropped)."""
        for _, crc, _ in self._queue:
            if isinstance(crc, Future):
                try:
                    crc.result()
                except BaseException:  # noqa: BLE001, S110 - the first error is propagating
                    pass
        self._queue.clear()


def storage_name(entry: Entry, backend: str) -> str:
    """The ``storage`` attribute ``backend`` writes for ``entry``."""
    return backend_record(backend).storage_name(entry.format)
