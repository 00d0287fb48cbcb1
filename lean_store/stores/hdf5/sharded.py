"""HDF5 sharded save: a checkpoint directory holding one file per writing rank
(``shard-RRRRR-of-WWWWW.h5``, one chunked dataset per owned shard) and a master file
(``lean_store.h5``) whose virtual datasets stitch the shards into whole tensors.

Virtual-dataset sources are relative file names, so the directory can be moved or copied;
HDF5 resolves them next to the master file. h5py and h5dump read whole tensors from the master
without lean_store. The reader accepts a virtual dataset only when every source is a sibling
shard file of this checkpoint (a regular file, no link), mapped one box to one whole source
dataset, and the boxes equal the recorded shards.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from h5py import h5d, h5p, h5s

from ...chunking import plan_chunks
from ...distributed.plan import TensorPlan
from ...distributed.shard_spec import Box
from ...errors import CheckpointError, IntegrityError, UnsafeFileError
from ...layout import Entry
from ...metadata import tensor_attrs
from ...naming import node_name
from ...replacement import PinnedRoot, check_unchanged
from ..base import Selection, StoredTensor
from .store import HDF5Reader, HDF5Writer, from_hdf5_attr, to_hdf5_attr
from .types import hdf5_type, storage_kind

MASTER_NAME = "lean_store.h5"
CHECKSUM = "fletcher32+crc32c"
"""The checksum of every shard file (the ``checksum`` save option a sharded save honours)."""
MASTER_LIBVER = ("v108", "v110")  # virtual datasets need the 1.10 format; h5dump 1.10 reads it
_SHARD_FILE = re.compile(r"^shard-(\d{5})-of-(\d{5})\.h5$")
_SOURCE_DSET = re.compile(r"^/t(\d{6})-s(\d{5})$")


def shard_file_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.h5"


def source_name(index: int, k: int) -> str:
    return f"t{index:06d}-s{k:05d}"


def open_rank_writer(work: str, rank: int, world: int, chunk_bytes: int, compression: Any
                     ) -> HDF5Writer:
    """This rank's shard file (itself written to a temporary name and renamed when done).
    Shard files keep HDF5's fletcher32 filter besides the chunk_crc32c table: whole tensors
    are read through the master's virtual datasets, where only HDF5's own filter is checked."""
    return HDF5Writer(Path(work) / shard_file_name(rank, world), chunk_bytes=chunk_bytes,
                      compression=compression, checksum=CHECKSUM)


def shard_entry(plan: TensorPlan, k: int, box: Box) -> Entry:
    return Entry(plan.entry.index, source_name(plan.entry.index, k), box.lengths,
                 plan.entry.format)


def write_master(work: str, world: int, plans: list[TensorPlan], records: list[str],
                 root_attrs: dict[str, Any], chunk_bytes: int) -> None:
    """Rank 0, after every rank succeeded: the master file, ``complete`` written last."""
    path = Path(work) / MASTER_NAME
    with h5py.File(path, "w", libver=MASTER_LIBVER, track_order=True) as f:
        for plan, shards in zip(plans, records):
            entry = plan.entry
            shape = plan.stored_shape
            ftype = hdf5_type(entry.format)
            dcpl = h5p.create(h5p.DATASET_CREATE)
            if math.prod(shape) == 0:
                dcpl.set_chunk(plan_chunks(shape, ftype.get_size(), chunk_bytes))
                dcpl.set_fletcher32()
            for k, (box, owner) in enumerate(plan.shards):
                vspace = h5s.create_simple(shape)
                vspace.select_hyperslab(box.offsets, box.lengths)
                dcpl.set_virtual(
                    vspace, shard_file_name(owner, world).encode(),
                    ("/" + source_name(entry.index, k)).encode(), h5s.create_simple(box.lengths),
                )
            dset = h5d.create(f.id, node_name(entry.name).encode(), ftype,
                              h5s.create_simple(shape), dcpl=dcpl)
            ds = h5py.Dataset(dset)
            attrs = tensor_attrs(entry, storage_kind(entry.format))
            attrs["shards"] = shards
            for key, value in attrs.items():
                ds.attrs[key] = to_hdf5_attr(value)
        for key, value in root_attrs.items():
            f.attrs[key] = to_hdf5_attr(value)
        f.attrs["complete"] = 1  # written last: a master without it is incomplete


def is_sharded_dir(path: Any) -> bool:
    p = Path(path)
    return p.is_dir() and (p / MASTER_NAME).is_file()


class ShardedHDF5Reader(HDF5Reader):
    """Reads a sharded HDF5 checkpoint directory through its master file's virtual datasets."""

    def __init__(self, directory: Any) -> None:
        self.directory = Path(directory)
        master = self.directory / MASTER_NAME
        # HDF5 opens the shard files of virtual datasets by name when it reads them: each read
        # is handed out only if the directory is still the one opened (docs/SECURITY.md)
        self._pin = PinnedRoot.of(self.directory)
        try:
            if master.is_symlink() or not master.is_file():
                raise IntegrityError(f"{directory}: no master file {MASTER_NAME}")
            super().__init__(master)
        except BaseException:
            if self._pin is not None:
                self._pin.close()
            raise
        self._sources: dict[str, HDF5Reader] = {}

    def check_current(self) -> None:
        check_unchanged(self._pin, str(self.directory))

    def read(self, node: str, selection: Any, fmt: Any, out: Any = None) -> Any:
        try:
            words = super().read(node, selection, fmt, out)
        except IntegrityError:
            self.check_current()  # a shard file deleted by a save replacing the directory
            raise
        self.check_current()
        return words

    def stored(self, node: str) -> StoredTensor:
        ds = self._dataset(node)
        dcpl = ds.id.get_create_plist()
        if dcpl.get_layout() != h5d.VIRTUAL:
            return super().stored(node)
        try:
            attrs = {k: from_hdf5_attr(v) for k, v in ds.attrs.items()}
            mappings = self._mappings(node, dcpl, tuple(ds.shape))
        except (OSError, RuntimeError, ValueError, TypeError, KeyError) as exc:
            raise IntegrityError(f"{node!r}: unreadable virtual dataset ({exc})") from None
        filters: list[str] = []
        on_disk = 0
        for box, fname, dset in mappings:
            info = self._source(fname).stored(dset.lstrip("/"))
            if info.stored_shape != box.lengths:
                raise UnsafeFileError(
                    f"{node!r}: source {fname}:{dset} of shape {info.stored_shape} is mapped to "
                    f"the box {box}"
                )
            filters = info.filters
            on_disk += info.nbytes_on_disk or 0
        ftype = ds.id.get_type()
        self._types[node] = ftype
        attrs["virtual_boxes"] = [box.to_json() for box, _, _ in mappings]
        return StoredTensor(
            node=node, attrs=attrs, stored_shape=tuple(ds.shape), chunk_shape=tuple(ds.shape),
            storage="hdf5", itemsize=ftype.get_size(), nbytes_on_disk=on_disk, filters=filters,
        )

    def read_shard_region(self, node: str, region: tuple[slice, ...], fmt: Any,
                          out: np.ndarray | None = None) -> np.ndarray | None:
        """Raw words of ``region`` (global coordinates) read straight from the one shard file
        holding all of it, with that file's chunk checks; None when ``node`` is not virtual or
        no single shard holds the region (read through the master then)."""
        ds = self._dataset(node)
        dcpl = ds.id.get_create_plist()
        if dcpl.get_layout() != h5d.VIRTUAL:
            return None
        want = Box(tuple(s.start for s in region), tuple(s.stop - s.start for s in region))
        for box, fname, dset in self._mappings(node, dcpl, tuple(ds.shape)):
            if box.intersect(want) == want:
                return self._source(fname).read(
                    dset.lstrip("/"), Selection.of_region(box.local(region)), fmt, out)
        return None

    def _mappings(self, node: str, dcpl: Any, shape: tuple[int, ...]
                  ) -> list[tuple[Box, str, str]]:
        out = []
        for i in range(dcpl.get_virtual_count()):
            fname = dcpl.get_virtual_filename(i)
            dset = dcpl.get_virtual_dsetname(i)
            if not _SHARD_FILE.match(fname) or not _SOURCE_DSET.match(dset):
                raise UnsafeFileError(
                    f"{node!r}: virtual source {fname!r}:{dset!r} is not a shard of this "
                    "checkpoint; only sibling shard files are read"
                )
            vspace = dcpl.get_virtual_vspace(i)
            src = dcpl.get_virtual_srcspace(i)
            if vspace.get_select_type() != h5s.SEL_HYPERSLABS or src.get_select_type() != (
                h5s.SEL_ALL
            ):
                raise UnsafeFileError(f"{node!r}: virtual mapping {i} is not one box")
            lo, hi = vspace.get_select_bounds()
            box = Box(tuple(lo), tuple(h - lo_ + 1 for lo_, h in zip(lo, hi)))
            if vspace.get_select_npoints() != box.size:
                raise UnsafeFileError(f"{node!r}: virtual mapping {i} is not one whole box")
            out.append((box, fname, dset))
        return out

    def _source(self, fname: str) -> HDF5Reader:
        reader = self._sources.get(fname)
        if reader is None:
            path = self.directory / fname
            if path.is_symlink() or not path.is_file():
                raise IntegrityError(f"shard file {fname} of {self.directory} is missing")
            reader = HDF5Reader(path)
            self._sources[fname] = reader
        return reader

    def close(self) -> None:
        for reader in self._sources.values():
            reader.close()
        self._sources.clear()
        if self._pin is not None:
            self._pin.close()
        super().close()


def check_virtual_boxes(name: str, info: StoredTensor, boxes: list[Box]) -> None:
    """The virtual mappings must be exactly the recorded shards."""
    mapped = info.attrs.get("virtual_boxes")
    if mapped is None:
        return
    got = sorted(Box.of(m["offsets"], m["lengths"]) for m in mapped)
    if got != sorted(boxes):
        raise IntegrityError(
            f"tensor {name!r}: the master file's virtual mappings {[str(b) for b in got]} differ "
            f"from the recorded shards {[str(b) for b in sorted(boxes)]}"
        )


def require_local(path: Any) -> None:
    if isinstance(path, str) and "://" in path:
        raise CheckpointError("sharded HDF5 checkpoints need a file system path; use Zarr for URLs")


def sharded_dir_of(path: Any) -> Path | None:
    """The checkpoint directory when ``path`` is a sharded HDF5 checkpoint (the directory or
    its master file), else None."""
    if not isinstance(path, (str, Path)):
        return None
    p = Path(path)
    if is_sharded_dir(p):
        return p
    if p.name == MASTER_NAME and p.is_file():
        return p.parent
    return None
