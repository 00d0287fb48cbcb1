"""The save pipeline: a source's tensors, one write unit at a time, into a store writer."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .chunking import iter_regions
from .integrity import crc32c_combine, crc32c_of
from .layout import Entry, Layout, stored_rank_shape
from .metadata import root_attrs, tensor_attrs
from .naming import check_names
from .options import SaveOptions, merge_options
from .progress import NullProgress, make_progress
from .sources import TensorSource
from .stores.registry import backend_for, backend_record, open_writer
from .stream import staged

OVERLAP_CRC_BYTES = 1 << 20
"""Write units at least this large have their CRC-32C computed in a thread while written."""

_CRC_POOL: ThreadPoolExecutor | None = None
_CRC_POOL_LOCK = threading.Lock()


def _crc_pool() -> ThreadPoolExecutor:
    """The CRC workers every save shares: started once per process, not once per save (a
    thread start waits for the new thread to be scheduled: milliseconds on a busy machine,
    against an incremental step of a few tens of milliseconds)."""
    global _CRC_POOL
    with _CRC_POOL_LOCK:
        if _CRC_POOL is None:
            _CRC_POOL = ThreadPoolExecutor(2, thread_name_prefix="lean_store-crc")
        return _CRC_POOL


def _forget_crc_pool() -> None:
    """In a forked child the parent's worker threads do not exist: start afresh."""
    global _CRC_POOL, _CRC_POOL_LOCK
    _CRC_POOL, _CRC_POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_crc_pool)


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
    storage_of = backend_record(backend).storage_name

    def units() -> Iterator[tuple[Any, Any, Any]]:
        for entry, tensor in source.tensors():
            sink = writer.add_tensor(entry, tensor_attrs(entry, storage_of(entry.format)))
            for region in iter_regions(stored_rank_shape(entry), sink.write_unit):
                yield sink, tensor, region
            yield sink, None, None  # end of this tensor

    crc_pool = _crc_pool()
    with writer, make_progress(progress, f"save {Path(path).name}", layout.nbytes) as bar:
        crc = 0
        counting = type(bar) is not NullProgress  # no call per unit without a bar
        for sink, region, bits in staged(units(), buffer_bytes=buffer_bytes):
            if bits is None:
                sink.close({"crc32c": crc})
                crc = 0
                continue
            # one pass: the unit's CRC, combined into the digest; large units have it computed
            # on another core while the store writes them (crc32c releases the GIL)
            if sink.defers_crc and bits.nbytes >= OVERLAP_CRC_BYTES:
                lazy = _LazyCRC(crc_pool, bits)
                try:
                    known = sink.write(region, bits, lazy)
                finally:  # the CRC reads ``bits``: done before its buffer can be reused
                    unit_crc = lazy() if known is None else known
                crc = crc32c_combine(crc, unit_crc, bits.nbytes)
                bar.advance(bits.nbytes)
                continue
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
            else:
                unit_crc = crc32c_of(bits)
                sink.write(region, bits, unit_crc)
            crc = crc32c_combine(crc, unit_crc, bits.nbytes)
            if counting:
                bar.advance(bits.nbytes)
        writer.commit(root_attrs(layout, kind, extra_root))
    return layout


class _LazyCRC:
    """The CRC-32C of ``bits``, computed on the CRC workers only once asked for."""

    def __init__(self, pool: ThreadPoolExecutor, bits: Any) -> None:
        self._pool = pool
        self._bits = bits
        self._value: int | None = None

    def __call__(self) -> int:
        if self._value is None:
            try:
                self._value = self._pool.submit(crc32c_of, self._bits).result()
            except RuntimeError:  # pools refuse work once interpreter shutdown has begun
                self._value = crc32c_of(self._bits)
        return self._value


def storage_name(entry: Entry, backend: str) -> str:
    """The ``storage`` attribute ``backend`` writes for ``entry``."""
    return backend_record(backend).storage_name(entry.format)
