"""HDF5 sharded save: a checkpoint directory holding one file per writing rank
(``shard-RRRRR-of-WWWWW.h5``, one chunked dataset per owned shard) and a master file
(``lean_store.h5``) whose virtual datasets stitch the shards into whole tensors.

Virtual-dataset sources are relative file names, so the directory can be moved or copied;
HDF5 resolves them next to the master file. h5py and h5dump read whole tensors from the master
without lean_store. The reader accepts a virtual dataset only when every source is a sibling
shard file of this checkpoint (a regular file, no link), mapped one box to one whole source
dataset, and the boxes equal the recorded shards. Each source dataset is checked (its shard
file, structure and shape against its box) before any of its data is read: when the master is
opened, or, inside :func:`deferred_source_checks` (a sharded load, where a rank reads only its
own part), when a read first touches it; reads held by one shard go straight to its file, with
its per-chunk CRC-32C table.

The master's root attribute ``master_manifest`` (:mod:`.master_manifest`) holds every master
dataset's attributes and mappings in one read. A sharded load describes the tensors from it;
outside one, each master dataset is read and compared with its record when the master is
opened. Masters without it (written before it existed) are read from their datasets.
"""

from __future__ import annotations

import contextvars
import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from h5py import h5d, h5o, h5p, h5s

from ...chunking import plan_chunks
from ...distributed.plan import TensorPlan
from ...distributed.shard_spec import Box, ChunkPlan
from ...errors import CheckpointError, IntegrityError, UnsafeFileError
from ...hardening import link_inside
from ...layout import Entry
from ...metadata import tensor_attrs
from ...naming import node_name
from ...replacement import PinnedRoot, check_unchanged
from .. import sharded_layout
from ..base import ChunkProblem, Selection, StoredTensor
from ..sharded_layout import RankShardWriter, ShardedLayout
from .attrs import encode_attr, read_attrs, to_hdf5_attr, write_attrs
from .files import close_written, open_for_writing
from .header_attrs import ExpectedAttr, expected_attr
from .master_manifest import (
    MASTER_MANIFEST_ATTR,
    SHARD_FILE,
    SOURCE_DSET,
    MasterRecord,
    master_differences,
    master_manifest_text,
    parse_master_manifest,
)
from .master_manifest import record_json as master_record_json
from .store import ATTR_PHASE_CHANGE, TRACK_TIMES, HDF5Reader, HDF5Writer
from .types import hdf5_type, storage_kind

MASTER_NAME = "lean_store.h5"
_DEFER_SOURCES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "lean_store_defer_shard_sources", default=False)
CHECKSUM = "fletcher32+crc32c"
"""The checksum of every shard file (the ``checksum`` save option a sharded save honours)."""
MASTER_LIBVER = ("v108", "v110")  # virtual datasets need the 1.10 format; h5dump 1.10 reads it


def shard_file_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.h5"


def source_name(index: int, k: int) -> str:
    return f"t{index:06d}-s{k:05d}"


def open_rank_writer(work: str, rank: int, world: int, chunk_bytes: int, compression: Any
                     ) -> HDF5Writer:
    """This rank's shard file (itself written to a temporary name and renamed when done).
    Shard files keep HDF5's fletcher32 filter besides the chunk_crc32c table: whole tensors
    are read through the master's virtual datasets, where only HDF5's own filter is checked.
    For the same reason ``"weights"`` is HDF5's own shuffle + deflate here (``"weights-gzip"``):
    HDF5 reads through virtual datasets with its own filters, and has no Blosc."""
    if compression == "weights":
        compression = "weights-gzip"
    return HDF5Writer(Path(work) / shard_file_name(rank, world), chunk_bytes=chunk_bytes,
                      compression=compression, checksum=CHECKSUM)


def shard_entry(plan: TensorPlan, k: int, box: Box) -> Entry:
    return Entry(plan.entry.index, source_name(plan.entry.index, k), box.lengths,
                 plan.entry.format)


class OpenMaster:
    """The master file and its datasets, kept open from the write stage (rank 0 writes the
    datasets while the other ranks write shards) to the commit, which adds the shard records:
    the datasets are not opened a second time by name."""

    def __init__(self, file: h5py.File, datasets: list[Any], token: int | None) -> None:
        self.file = file
        self.datasets = datasets  # h5d.DatasetID, one per plan, in plan order
        self._token = token  # files.open_for_writing's

    def close(self) -> None:
        self.datasets = []
        close_written(self.file, self._token)  # also when already closed: forgets the token


def write_master(work: str, world: int, plans: list[TensorPlan], records: list[str],
                 root_attrs: dict[str, Any], chunk_bytes: int,
                 master: OpenMaster | None = None) -> None:
    """Rank 0, after every rank succeeded: the master file, ``complete`` written last. Its
    datasets are ``master`` when rank 0 wrote them during the write stage
    (:func:`open_master_datasets`), those of a master without ``complete`` in the work
    directory, or are written here."""
    path = Path(work) / MASTER_NAME
    if master is None:
        if path.exists():
            f, token = open_for_writing(path, "r+", libver=MASTER_LIBVER)
            master = OpenMaster(f, [h5o.open(f.id, node_name(p.entry.name).encode())
                                    for p in plans], token)
        else:
            master = open_master_datasets(work, world, plans, chunk_bytes)
    try:
        manifest: list[dict[str, Any]] = []
        names = [shard_file_name(r, world) for r in range(world)]
        for plan, shards, dset in zip(plans, records, master.datasets):
            entry = plan.entry
            write_attrs(dset, {"shards": shards})
            attrs = {**tensor_attrs(entry, storage_kind(entry.format)), "shards": shards}
            sources = [] if math.prod(plan.stored_shape) == 0 else [
                (box, names[owner], "/" + source_name(entry.index, k))
                for k, (box, owner) in enumerate(plan.shards)]
            manifest.append(master_record_json(node_name(entry.name), attrs,
                                               plan.stored_shape, sources))
        f = master.file
        # every dataset's record in one read (docs/FORMAT.md 6.1.1)
        f.attrs[MASTER_MANIFEST_ATTR] = to_hdf5_attr(master_manifest_text(manifest))
        for key, value in root_attrs.items():
            f.attrs[key] = to_hdf5_attr(value)
        f.attrs["complete"] = 1  # written last: a master without it is incomplete
    finally:
        master.close()


def open_master_datasets(work: str, world: int, plans: list[TensorPlan],
                         chunk_bytes: int) -> OpenMaster:
    """Rank 0: the master file's datasets (each virtual dataset's mappings and the tensor's
    attributes, all but ``shards``, which needs every rank's digests), without root
    attributes, left open for :func:`write_master`. Done during the write stage, alongside the
    other ranks' shard writes, so the commit adds only the shard records, the manifest and the
    root attributes. File types, dataspaces and source names are made once each."""
    path = Path(work) / MASTER_NAME
    f, token = open_for_writing(path, "w", libver=MASTER_LIBVER, track_order=True)
    datasets: list[Any] = []
    try:
        ftypes: dict[Any, Any] = {}
        spaces: dict[tuple[int, ...], Any] = {}
        files = [shard_file_name(r, world).encode() for r in range(world)]

        def space(shape: tuple[int, ...]) -> Any:
            if shape not in spaces:
                spaces[shape] = h5s.create_simple(shape)
            return spaces[shape]

        for plan in plans:
            entry = plan.entry
            shape = plan.stored_shape
            ftype = ftypes.get(entry.format)
            if ftype is None:
                ftype = ftypes[entry.format] = hdf5_type(entry.format)
            dcpl = h5p.create(h5p.DATASET_CREATE)
            dcpl.set_attr_phase_change(*ATTR_PHASE_CHANGE)  # attributes in the object header
            dcpl.set_obj_track_times(TRACK_TIMES)
            if math.prod(shape) == 0:
                dcpl.set_chunk(plan_chunks(shape, ftype.get_size(), chunk_bytes))
                dcpl.set_fletcher32()
            else:
                for k, (box, owner) in enumerate(plan.shards):
                    vspace = h5s.create_simple(shape)  # a selection of its own per mapping
                    vspace.select_hyperslab(box.offsets, box.lengths)
                    dcpl.set_virtual(vspace, files[owner],
                                     ("/" + source_name(entry.index, k)).encode(),
                                     space(box.lengths))
            dset = h5d.create(f.id, node_name(entry.name).encode(), ftype, space(shape),
                              dcpl=dcpl)
            # the types and spaces of h5py's attrs[...] = value
            write_attrs(dset, tensor_attrs(entry, storage_kind(entry.format)))
            datasets.append(dset)
    except BaseException:
        OpenMaster(f, datasets, token).close()
        raise
    return OpenMaster(f, datasets, token)


def write_master_datasets(work: str, world: int, plans: list[TensorPlan],
                          chunk_bytes: int) -> None:
    """:func:`open_master_datasets`, closed again (the master written in two steps)."""
    open_master_datasets(work, world, plans, chunk_bytes).close()


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
            if master.is_symlink():
                raise UnsafeFileError(link_inside(f"{directory}: master file {MASTER_NAME}",
                                                  master))
            if not master.is_file():
                raise IntegrityError(f"{directory}: no master file {MASTER_NAME}")
            super().__init__(master)
        except BaseException:
            if self._pin is not None:
                self._pin.close()
            raise
        self._sources: dict[str, HDF5Reader] = {}
        self._defer = _DEFER_SOURCES.get()
        self._virtual_maps: dict[str, list[tuple[Box, str, str]]] = {}  # node -> its mappings
        self._infos: dict[str, StoredTensor] = {}  # node -> what stored() returned
        self._checked: dict[tuple[str, str], StoredTensor] = {}  # (file, dataset) -> checked
        self._attr_names: list[str] | None = None  # the attribute names of the last dataset
        self._trusted: dict[str, list[str]] = {}  # file -> datasets checked by another rank
        # the master manifest (parsed on first use, after the header checks): inside
        # deferred_source_checks nodes are described from it, and their master datasets are
        # compared with it by check_metadata (_check_master)
        self._master_text = self.root_attrs.pop(MASTER_MANIFEST_ATTR, None)
        self._master_records: dict[str, MasterRecord] | None = None
        self._from_master: set[str] = set()  # described from the manifest, not yet checked
        self._expected_types: dict[str, Any] = {}  # node -> its format, checked with it

    def check_current(self) -> None:
        check_unchanged(self._pin, str(self.directory))

    @property
    def _master(self) -> dict[str, MasterRecord] | None:
        """node -> record of the ``master_manifest`` attribute; None in masters without one."""
        if self._master_records is None and self._master_text is not None:
            self._master_records = parse_master_manifest(self._master_text, self._where,
                                                         self._root_limit)
            self._master_text = None
        return self._master_records

    def read(self, node: str, selection: Any, fmt: Any, out: Any = None) -> Any:
        mappings = self._virtual_maps.get(node)
        if mappings is not None:
            touched = self._touched(mappings, selection)
            self._check_sources(node, touched)
            if len(touched) == 1 and _inside(touched[0][0], selection):
                box, fname, dset = touched[0]
                local = Selection(tuple(a - o for a, o in zip(selection.start, box.offsets)),
                                  selection.count, selection.step)
                try:  # one shard holds it: its own file, every chunk checked by its table
                    words = self._source(fname).read(dset.lstrip("/"), local, fmt, out)
                except IntegrityError:
                    self.check_current()
                    raise
                self.check_current()
                return words
        try:
            words = super().read(node, selection, fmt, out)
        except IntegrityError:
            self.check_current()  # a shard file deleted by a save replacing the directory
            raise
        self.check_current()
        return words

    def stored(self, node: str) -> StoredTensor:
        record = None if self._master is None else self._master.get(node)
        if record is not None and record.sources:
            info = self._stored_from_master(node, record)
            if not self._defer and node in self._from_master:
                # opened whole: the master dataset compared with its record now (its header's
                # bytes where they are as written, no value-by-value read) and every source
                # checked, as a sharded load's check_metadata and reads do
                self._check_master(node)
                info.itemsize = self._types[node].get_size()
                self._check_sources(node, self._virtual_maps[node])
            return info
        ds = self._dataset(node)
        dcpl = ds.id.get_create_plist()
        if dcpl.get_layout() != h5d.VIRTUAL:
            if record is not None and record.sources:
                raise IntegrityError(f"{node!r}: not a virtual dataset, but the master manifest "
                                     "maps it to shard files")
            return super().stored(node)
        attrs = None
        if self._attr_names is not None:  # opened by name: cheaper than by index
            try:
                attrs = read_attrs(ds.id, repr(node), self._attr_names)
            except IntegrityError:  # other names: read whatever is there
                attrs = None
        if attrs is None:
            attrs = read_attrs(ds.id, repr(node))  # each checked before it is read
            self._attr_names = list(attrs)
        try:
            mappings = self._mappings(node, dcpl, tuple(ds.shape))
        except (OSError, RuntimeError, ValueError, TypeError, KeyError) as exc:
            raise IntegrityError(f"{node!r}: unreadable virtual dataset ({exc})") from None
        ftype = ds.id.get_type()
        self._types[node] = ftype
        attrs["virtual_boxes"] = [box.to_json() for box, _, _ in mappings]
        # nbytes_on_disk and filters: the sources', filled in once they are checked
        info = StoredTensor(
            node=node, attrs=attrs, stored_shape=tuple(ds.shape), chunk_shape=tuple(ds.shape),
            storage="hdf5", itemsize=ftype.get_size(), nbytes_on_disk=None, filters=[],
        )
        self._virtual_maps[node] = mappings
        self._infos[node] = info
        if record is not None:  # read from the dataset: it must be what the manifest says
            self._raise_differences(node, record, master_differences(
                record, {k: v for k, v in attrs.items() if k != "virtual_boxes"},
                tuple(ds.shape), mappings))
        if not self._defer:
            self._check_sources(node, mappings)
        return info

    def _stored_from_master(self, node: str, record: MasterRecord) -> StoredTensor:
        """``node`` described from its master manifest record alone (no dataset opened), inside
        :func:`deferred_source_checks` only: a sharded load reads it straight from the shard
        files the record names, and has its master dataset compared with the record
        (:meth:`check_metadata`) by one rank before any rank installs anything."""
        known = self._infos.get(node)
        if known is not None:  # described already (and maybe checked): the same description
            return known
        attrs = dict(record.attrs)
        attrs["virtual_boxes"] = [box.to_json() for box, _, _ in record.sources]
        info = StoredTensor(
            node=node, attrs=attrs, stored_shape=record.stored_shape,
            chunk_shape=record.stored_shape, storage="hdf5", itemsize=0, nbytes_on_disk=None,
            filters=[],
        )
        self._virtual_maps[node] = list(record.sources)
        self._infos[node] = info
        self._from_master.add(node)
        return info

    def type_mismatch(self, node: str, fmt: Any) -> str | None:
        if node in self._from_master:  # compared with the dataset's own when it is checked
            self._expected_types[node] = fmt
            self._infos[node].itemsize = hdf5_type(fmt).get_size()
            return None
        return super().type_mismatch(node, fmt)

    def _check_master(self, node: str) -> None:
        """A node described from the master manifest: its master dataset (virtual layout,
        attributes, shape, mappings, datatype) must be what the manifest says. Once."""
        if node not in self._from_master:
            return
        assert self._master is not None
        record = self._master[node]
        dsid = self._dsid(node)  # low-level ids only: this runs for every master dataset
        dcpl = dsid.get_create_plist()
        if dcpl.get_layout() != h5d.VIRTUAL:
            problems = ["it is not a virtual dataset"]
        else:
            names = list(record.attrs)
            try:
                expected: list[ExpectedAttr] | None = [
                    expected_attr(k, v) for k, v in record.attrs.items()]
            except (OverflowError, ValueError, TypeError):  # no attribute can hold a value:
                expected = None  # read and compared below, which names it
            if self._as_written(dsid, expected, lambda: [
                    encode_attr(k, v) for k, v in record.attrs.items()]):
                attrs = dict(record.attrs)  # as written, from the header's bytes or libhdf5
            else:
                try:
                    attrs = read_attrs(dsid, repr(node), names)
                except IntegrityError:  # not the attributes written: read whatever is there
                    attrs = read_attrs(dsid, repr(node))
            shape = tuple(dsid.shape)
            try:
                mappings = self._mappings(node, dcpl, shape)
            except (OSError, RuntimeError, ValueError, TypeError, KeyError) as exc:
                raise IntegrityError(f"{node!r}: unreadable virtual dataset ({exc})") from None
            problems = master_differences(record, attrs, shape, mappings)
        ftype = dsid.get_type()
        fmt = self._expected_types.get(node)
        if fmt is not None and ftype != hdf5_type(fmt):
            problems.append(f"HDF5 datatype does not encode {fmt.tag}")
        self._raise_differences(node, record, problems)
        self._types[node] = ftype
        self._from_master.discard(node)

    def _raise_differences(self, node: str, record: MasterRecord, problems: list[str]) -> None:
        if problems:
            self.check_current()  # a master replaced by a save meanwhile: not tampering
            name = record.attrs.get("name", node)
            raise IntegrityError(
                f"tensor {name!r} (master dataset {node!r}) was changed after the save: "
                f"{'; '.join(problems)}"
            )

    def check_metadata(self, node: str) -> None:
        """The master dataset against its manifest record now (``verify``; reads do it before
        their first data)."""
        self._check_master(node)
        super().check_metadata(node)

    def metadata_checked_elsewhere(self, node: str) -> None:
        """Another rank compared ``node``'s master dataset with the manifest and every rank
        agreed: not again here."""
        self._from_master.discard(node)

    def check_region(self, node: str, box: Box) -> None:
        """Check every source dataset holding part of ``box`` of ``node``, its attributes
        against its shard file's manifest included (a no-op for one already checked, or a
        node that is not virtual): what a read of ``box`` needs, checked before any read."""
        mappings = self._virtual_maps.get(node)
        if mappings is not None:
            touched = [m for m in mappings if m[0].intersect(box) is not None]
            self._check_sources(node, touched)
            for _box, fname, dset in touched:
                self._source(fname).check_attributes(dset.lstrip("/"))

    def checked_elsewhere(self, node: str, box: Box) -> None:
        """Another rank read the shard ``box`` of ``node`` whole (its digest and attributes
        checked) and every rank agreed: its dataset's attributes are not compared again here."""
        for mapped, fname, dset in self._virtual_maps.get(node, []):
            if mapped != box:
                continue
            reader = self._sources.get(fname)
            if reader is not None:
                reader.trust_attributes(dset.lstrip("/"))
            else:  # applied if this rank ever opens that file (most ranks never do)
                self._trusted.setdefault(fname, []).append(dset.lstrip("/"))

    def _touched(self, mappings: list[tuple[Box, str, str]], selection: Any
                 ) -> list[tuple[Box, str, str]]:
        if any(n == 0 for n in selection.count):
            return []
        want = Box(tuple(selection.start), tuple(
            (n - 1) * st + 1 for n, st in zip(selection.count, selection.step)))
        return [m for m in mappings if m[0].intersect(want) is not None]

    def _check_sources(self, node: str, mappings: list[tuple[Box, str, str]]) -> None:
        """Each source: a sibling shard file, its dataset's structure checked by its reader,
        its shape the box it is mapped to."""
        for box, fname, dset in mappings:
            if (fname, dset) in self._checked:
                continue
            info = self._source(fname).stored(dset.lstrip("/"))
            if info.stored_shape != box.lengths:
                raise UnsafeFileError(
                    f"{node!r}: source {fname}:{dset} of shape {info.stored_shape} is mapped to "
                    f"the box {box}"
                )
            self._checked[fname, dset] = info
        whole = self._infos.get(node)
        every = self._virtual_maps.get(node, [])
        if whole is not None and whole.nbytes_on_disk is None and all(
                (f, d) in self._checked for _, f, d in every):
            infos = [self._checked[f, d] for _, f, d in every]
            whole.nbytes_on_disk = sum(i.nbytes_on_disk or 0 for i in infos)
            whole.filters = list(infos[-1].filters) if infos else []

    def structure_problems(self, node: str) -> list[ChunkProblem]:
        """A virtual dataset: the problems of each shard file's source dataset, named by it."""
        mappings = self._virtual(node)
        if not mappings:
            return super().structure_problems(node)
        problems: list[ChunkProblem] = []
        for _box, fname, dset in mappings:
            for chunk, message in self._source(fname).structure_problems(dset.lstrip("/")):
                where = f"{fname}:{dset}" + ("" if chunk is None else f" chunk {chunk}")
                problems.append((None, f"{where}: {message}"))
        return problems

    def _virtual(self, node: str) -> list[tuple[Box, str, str]]:
        """The mappings of virtual dataset ``node`` (parsed once); [] for any other dataset."""
        found = self._virtual_maps.get(node)
        if found is None:
            ds = self._dataset(node)
            dcpl = ds.id.get_create_plist()
            found = [] if dcpl.get_layout() != h5d.VIRTUAL else self._mappings(
                node, dcpl, tuple(ds.shape))
            self._virtual_maps[node] = found
        return found

    def _mappings(self, node: str, dcpl: Any, shape: tuple[int, ...]
                  ) -> list[tuple[Box, str, str]]:
        out = []
        for i in range(dcpl.get_virtual_count()):
            fname = dcpl.get_virtual_filename(i)
            dset = dcpl.get_virtual_dsetname(i)
            if not SHARD_FILE.match(fname) or not SOURCE_DSET.match(dset):
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
            if path.is_symlink():
                raise UnsafeFileError(link_inside(f"shard file {fname} of {self.directory}",
                                                  path))
            if not path.is_file():
                raise IntegrityError(f"shard file {fname} of {self.directory} is missing")
            reader = HDF5Reader(path)
            self._sources[fname] = reader
            # its root group listed once: the object header addresses its one-chunk datasets
            # are read from (never opened through libhdf5), and any link that is not a hard
            # link to a dataset refused
            reader.nodes()
            for dset in self._trusted.pop(fname, []):
                reader.trust_attributes(dset)
        return reader

    def close(self) -> None:
        for reader in self._sources.values():
            reader.close()
        self._sources.clear()
        if self._pin is not None:
            self._pin.close()
        super().close()


@contextmanager
def deferred_source_checks() -> Iterator[None]:
    """Sharded HDF5 checkpoints opened inside check each source dataset when a read (or
    :meth:`ShardedHDF5Reader.check_region`) first needs it, not all of them when opened; with
    a master manifest, tensors are described from it and each master dataset is compared with
    its record only by :meth:`ShardedHDF5Reader.check_metadata`, which the caller (a sharded
    load: every tensor by one rank, the ranks agreeing before anything is installed) runs."""
    token = _DEFER_SOURCES.set(True)
    try:
        yield
    finally:
        _DEFER_SOURCES.reset(token)


def _inside(box: Box, selection: Any) -> bool:
    return all(o <= a and a + (n - 1) * st < o + ln for o, ln, a, n, st in zip(
        box.offsets, box.lengths, selection.start, selection.count, selection.step))


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


class _HDF5RankWriter(RankShardWriter):
    def __init__(self, writer: HDF5Writer, rank: int, world: int) -> None:
        self._writer, self._rank, self._world = writer, rank, world

    def write(self, plan: TensorPlan, chunk: ChunkPlan | None, k: int, box: Box,
              read: Callable[[tuple[slice, ...]], np.ndarray]) -> tuple[int, tuple[int, ...]]:
        sink = self._writer.add_tensor(shard_entry(plan, k, box), {
            "tensor": plan.entry.name, "shard": k, "offsets": box.offsets})
        crc = sharded_layout.write_box(read, box, sink.write_unit,
                        lambda region, bits: sink.write(box.local(region), bits))
        sink.close({"crc32c": crc})
        return crc, tuple(sink.write_unit)

    def __enter__(self) -> _HDF5RankWriter:
        self._writer.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            try:
                self._writer.commit({"lean_store_shard": json.dumps(
                    {"rank": self._rank, "world_size": self._world}, separators=(",", ":"))})
            except BaseException as error:
                self._writer.__exit__(type(error), error, error.__traceback__)
                raise
        self._writer.__exit__(*exc)


class HDF5ShardedLayout(ShardedLayout):
    """One shard file per writing rank and a master file of virtual datasets. Rank 0's
    instance keeps the master open from :meth:`write_metadata` to :meth:`finish` (or
    :meth:`abort`)."""

    checksum = CHECKSUM

    def __init__(self) -> None:
        self._master: OpenMaster | None = None

    def check_target(self, path: Any) -> None:
        require_local(path)

    def chunk_plans(self, plans: list[TensorPlan], chunk_bytes: int, *,
                    always_aligned: bool = False) -> list[ChunkPlan | None]:
        return [None] * len(plans)  # each rank chunks the datasets of its own file

    def rank_writer(self, work: str, rank: int, world: int, chunk_bytes: int,
                    compression: Any) -> RankShardWriter:
        return _HDF5RankWriter(open_rank_writer(work, rank, world, chunk_bytes, compression),
                               rank, world)

    def write_metadata(self, work: str, world: int, plans: list[TensorPlan],
                       chunk_bytes: int) -> None:
        self.abort()
        self._master = open_master_datasets(work, world, plans, chunk_bytes)

    def finish(self, work: str, world: int, plans: list[TensorPlan], records: list[str],
               root_attrs: dict[str, Any], chunk_bytes: int) -> None:
        master, self._master = self._master, None
        write_master(work, world, plans, records, root_attrs, chunk_bytes, master)

    def abort(self) -> None:
        if self._master is not None:
            master, self._master = self._master, None
            master.close()
