"""A small lean_store reader written only from docs/FORMAT.md, never from the library's source.

It checks that the spec is complete: ``tests/interop/test_spec_reader.py`` reads files lean_store
wrote through it and compares the bits with what was saved. It imports h5py (HDF5 containers),
numpy and google_crc32c, and reads Zarr with plain ``json`` and file reads; it must never import
``lean_store``. Section numbers below are FORMAT.md's.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np

# 1.8: the standard binary float formats (e, f, bias, encoding)
STANDARD_FLOATS = {
    "float64": (11, 52, 1023, "ieee"), "float32": (8, 23, 127, "ieee"),
    "float16": (5, 10, 15, "ieee"), "bfloat16": (8, 7, 127, "ieee"),
    "float8_e4m3fn": (4, 3, 7, "finite-max-nan"),
    "float8_e4m3fnuz": (4, 3, 8, "finite-unsigned-zero"),
    "float8_e5m2": (5, 2, 15, "ieee"), "float8_e5m2fnuz": (5, 2, 16, "finite-unsigned-zero"),
    "float8_e4m3": (4, 3, 7, "ieee"), "float8_e3m4": (3, 4, 3, "ieee"),
    "float6_e2m3fn": (2, 3, 1, "finite"), "float6_e3m2fn": (3, 2, 3, "finite"),
    "float4_e2m1fn": (2, 1, 1, "finite"),
}
INTEGERS = {f"{s}int{n}": n for n in (8, 16, 32, 64) for s in ("", "u")}
_BINARY = re.compile(r"^binary_(0|[1-9]\d*)_(0|[1-9]\d*)_(0|[1-9]\d*)_"
                     r"(ieee|finite-max-nan|finite-unsigned-zero|finite)$")
_ZARR_NATIVE = {  # 2.6: Zarr data type of storage "native" -> numpy dtype (little-endian)
    "float16": "<f2", "float32": "<f4", "float64": "<f8", "bool": "|b1",
    "complex64": "<c8", "complex128": "<c16", "int8": "|i1", "uint8": "|u1",
    "int16": "<i2", "uint16": "<u2", "int32": "<i4", "uint32": "<u4", "int64": "<i8",
    "uint64": "<u8",
}


class SpecError(Exception):
    """The file breaks a rule of FORMAT.md."""


@dataclass(frozen=True)
class Fmt:
    """A scalar format as section 1 describes it."""

    tag: str
    kind: str  # "binary" | "exponent" | "int" | "bool" | "complex"
    width: int  # 2.3's width attribute
    word_width: int  # bits of one word (the component's for complex)
    params: tuple[int, int, int, str] | None = None  # (e, f, bias, encoding) for binary
    component: Fmt | None = None

    @property
    def container(self) -> np.dtype:
        """1.5: the smallest unsigned container of the word width, little-endian."""
        for bits, name in ((8, "<u1"), (16, "<u2"), (32, "<u4"), (64, "<u8")):
            if self.word_width <= bits:
                return np.dtype(name)
        raise SpecError(f"{self.tag}: width {self.word_width}")

    @property
    def words_per_value(self) -> int:
        return 2 if self.kind == "complex" else 1


def parse_tag(tag: str) -> Fmt:
    """1.1: a canonical tag."""
    if tag in STANDARD_FLOATS:
        e, f, bias, enc = STANDARD_FLOATS[tag]
        return Fmt(tag, "binary", 1 + e + f, 1 + e + f, (e, f, bias, enc))
    if tag == "float8_e8m0fnu":
        return Fmt(tag, "exponent", 8, 8)
    if tag in INTEGERS:
        return Fmt(tag, "int", INTEGERS[tag], INTEGERS[tag])
    if tag == "bool":
        return Fmt(tag, "bool", 8, 8)
    if tag in ("complex64", "complex128") or (tag.startswith("complex(") and tag.endswith(")")):
        inner = {"complex64": "float32", "complex128": "float64"}.get(tag, tag[8:-1])
        comp = parse_tag(inner)
        if comp.kind != "binary":
            raise SpecError(f"{tag}: a complex component must be a binary float format")
        return Fmt(tag, "complex", 2 * comp.width, comp.word_width, component=comp)
    m = _BINARY.match(tag)
    if m:
        e, f, bias = (int(m.group(i)) for i in (1, 2, 3))
        if not (e >= 2 and f >= 1 and 1 + e + f <= 64 and bias <= 2**e - 1):
            raise SpecError(f"{tag}: parameters out of range")
        return Fmt(tag, "binary", 1 + e + f, 1 + e + f, (e, f, bias, m.group(4)))
    raise SpecError(f"unknown format tag {tag!r}")


def decode_binary(words: np.ndarray, fmt: Fmt) -> np.ndarray:
    """1.2: values of binary float words (float64; exact for the formats that embed)."""
    assert fmt.params is not None
    e, f, bias, enc = fmt.params
    w = words.astype(np.uint64)
    s = (w >> np.uint64(e + f)) & np.uint64(1)
    E = ((w >> np.uint64(f)) & np.uint64(2**e - 1)).astype(np.int64)
    M = (w & np.uint64(2**f - 1)).astype(np.float64)
    mag = np.where(E == 0, M * 2.0 ** (1 - bias - f),
                   (2.0**f + M) * np.exp2((E - bias - f).astype(np.float64)))
    out = np.where(s == 1, -mag, mag)
    top = E == 2**e - 1
    if enc == "ieee":
        out = np.where(top & (M == 0), np.where(s == 1, -np.inf, np.inf), out)
        out = np.where(top & (M != 0), np.nan, out)
    elif enc == "finite-max-nan":
        out = np.where(top & (M == 2**f - 1), np.nan, out)
    elif enc == "finite-unsigned-zero":
        out = np.where((s == 1) & (E == 0) & (M == 0), np.nan, out)
    return out


# ------------------------------------------------------------------------------ section 2.1


def unescaped_node_name(name: str) -> str:
    """2.1: escape every character outside [A-Za-z0-9._-], and a leading '.' or '_' (the node
    name before the zarr.json rule)."""
    out = []
    for i, ch in enumerate(name):
        keep = ch.isascii() and (ch.isalnum() or ch in "._-") and not (i == 0 and ch in "._")
        out.append(ch if keep else "".join(f"%{b:02X}" for b in ch.encode("utf-8")))
    return "".join(out)


def node_name(name: str) -> str:
    """2.1: the escaped name, then the first character of `zarr.json` in any case escaped."""
    node = unescaped_node_name(name)
    if node.lower() == "zarr.json":
        node = "".join(f"%{b:02X}" for b in node[0].encode("utf-8")) + node[1:]
    return node


def find_node(name: str, present: Any) -> str:
    """2.1: the node of tensor ``name`` in a store holding the nodes ``present`` (a container):
    its node name, or else the unescaped one a writer before the zarr.json rule gave it."""
    node = node_name(name)
    if node not in present and unescaped_node_name(name) in present:
        return unescaped_node_name(name)
    return node


# ------------------------------------------------------------------------------ section 3


def crc32c(data: bytes | np.ndarray) -> int:
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).tobytes()
    return int(google_crc32c.value(bytes(data)))


def le_bytes(words: np.ndarray) -> bytes:
    return np.ascontiguousarray(words.astype(words.dtype.newbyteorder("<"))).tobytes()


def grid_regions(shape: tuple[int, ...], unit: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """Boxes of ``unit`` tiling ``shape`` from its origin, clipped, in C order of the grid."""
    if any(d == 0 for d in shape):
        return []
    counts = [math.ceil(d / u) for d, u in zip(shape, unit)]
    return [tuple(slice(i * u, min((i + 1) * u, d)) for i, u, d in zip(idx, unit, shape))
            for idx in np.ndindex(*counts)]


def crc_by_units(words: np.ndarray, unit: tuple[int, ...]) -> int:
    """CRC-32C of ``words`` taken tile by tile (chunk_crc32c order, 6's shard digests)."""
    crc = 0
    for region in grid_regions(words.shape[: len(unit)], unit):
        crc = int(google_crc32c.extend(crc, le_bytes(words[region])))
    return crc


# ------------------------------------------------------------------------------ reading


@dataclass
class Tensor:
    name: str
    fmt: Fmt
    shape: tuple[int, ...]
    words: np.ndarray  # container words, shape + (2,) for complex


def _check_entry(entry: dict, attrs: dict) -> Fmt:
    """2.3: the tensor attributes agree with the layout; the per-format attributes exist."""
    fmt = parse_tag(entry["format"])
    for key in ("index", "name", "format", "width"):
        if attrs[key] != entry[key]:
            raise SpecError(f"{entry['name']}: attribute {key} {attrs[key]!r} != layout")
    if [int(d) for d in attrs["shape"]] != entry["shape"] or fmt.width != entry["width"]:
        raise SpecError(f"{entry['name']}: shape or width disagree")
    binary_keys = {"exponent_bits", "fraction_bits", "bias", "encoding"}
    if fmt.kind == "binary":
        got = (attrs["exponent_bits"], attrs["fraction_bits"], attrs["bias"], attrs["encoding"])
        if tuple(got) != fmt.params:
            raise SpecError(f"{entry['name']}: format parameters {got} != {fmt.params}")
    elif binary_keys & set(attrs):
        raise SpecError(f"{entry['name']}: binary attributes on a {fmt.kind} format")
    if fmt.kind == "complex" and attrs["component"] != fmt.component.tag:
        raise SpecError(f"{entry['name']}: component {attrs['component']!r}")
    return fmt


def _check_words(t: Tensor) -> None:
    """1.4/1.5: no bit above the width; bool bytes are 0 or 1."""
    if t.fmt.word_width < 8 * t.fmt.container.itemsize and t.words.size and (
        int(t.words.max()) >> t.fmt.word_width
    ):
        raise SpecError(f"{t.name}: a word has bits above the width")
    if t.fmt.kind == "bool" and t.words.size and int(t.words.max()) > 1:
        raise SpecError(f"{t.name}: bool byte other than 0/1")


def _root_checks(attrs: dict, complete_ok: bool) -> list[dict]:
    """3, check 1."""
    if attrs.get("lean_store") != "lean_store" or not complete_ok:
        raise SpecError("not a complete lean_store checkpoint")
    if attrs.get("format_version") != 1:
        raise SpecError(f"format_version {attrs.get('format_version')!r}")
    layout = json.loads(attrs["layout"])
    if attrs["tensor_count"] != len(layout):
        raise SpecError("tensor_count != len(layout)")
    return layout


def _hdf5_attrs(obj: Any) -> dict:
    out = {}
    for key, value in obj.attrs.items():
        if isinstance(value, bytes):
            value = value.decode("utf-8")
        elif isinstance(value, np.generic):
            value = value.item()
        out[key] = value
    return out


def _hdf5_words(ds: Any, fmt: Fmt) -> np.ndarray:
    """2.5: read with the memory type equal to the file type, into container words."""
    from h5py import h5s

    shape = tuple(ds.shape) + ((2,) if fmt.kind == "complex" else ())
    out = np.empty(shape, fmt.container)
    if out.size:
        ds.id.read(h5s.ALL, h5s.ALL, out, mtype=ds.id.get_type())
    return out


def read_hdf5(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of an HDF5 checkpoint (one file, or a sharded directory's master, 6.1),
    with the chunk CRCs (3), the digest (3) or the shard records (6) checked."""
    import h5py

    path = Path(path)
    directory = path if path.is_dir() else None
    master = path / "lean_store.h5" if directory else path
    out = {}
    with h5py.File(master, "r") as f:
        attrs = _hdf5_attrs(f)
        complete = attrs.get("complete")
        ok = isinstance(complete, int) and not isinstance(complete, bool) and complete == 1
        layout = _root_checks(attrs, ok)
        sharded = "sharded" in attrs
        for entry in layout:
            ds = f[find_node(entry["name"], f)]
            tattrs = _hdf5_attrs(ds)
            fmt = _check_entry(entry, tattrs)
            words = _hdf5_words(ds, fmt)
            stored = tuple(ds.shape)
            if sharded:
                _check_shards(entry["name"], tattrs, words, stored)
                if directory:
                    _check_hdf5_shard_files(directory, ds, entry, fmt, words, tattrs)
            else:
                table = np.asarray(tattrs["chunk_crc32c"])
                regions = grid_regions(stored, tuple(ds.chunks))
                got = [crc_by_units(words[r], tuple(ds.chunks)) for r in regions]
                if table.dtype != np.uint32 or list(table) != got:
                    raise SpecError(f"{entry['name']}: chunk_crc32c mismatch")
                if crc32c(le_bytes(words)) != tattrs["crc32c"]:
                    raise SpecError(f"{entry['name']}: digest mismatch")
            t = Tensor(entry["name"], fmt, tuple(entry["shape"]),
                       words.reshape(tuple(entry["shape"]) + words.shape[len(stored):]))
            _check_words(t)
            out[t.name] = t
    return out


def check_header_digests(path: str | Path) -> int:
    """2.5.2: the ``header_digests`` table of an HDF5 file, checked against the file's bytes
    as the spec describes it; the number of datasets it covers (0 without a table)."""
    import h5py

    raw = Path(path).read_bytes()
    with h5py.File(path, "r") as f:
        if "header_digests" not in f.attrs:
            return 0
        table = np.asarray(f.attrs["header_digests"])
        manifest = f.attrs["manifest"]
        text = manifest if isinstance(manifest, bytes) else manifest.encode("utf-8")
        records = json.loads(text)["tensors"]
        n = len(records)
        if table.dtype != np.dtype("<u8") or table.shape != ((n + 1) * 11,):
            raise SpecError(f"header_digests: {table.dtype} {table.shape} for {n} records")
        rows = table.reshape(n + 1, 11).tolist()
        rows_bytes = table.reshape(n + 1, 11)[1:].astype("<u8").tobytes()
        if rows[0] != [1, n, crc32c(text), crc32c(rows_bytes)] + [0] * 7:
            raise SpecError("header_digests: row 0 does not bind the table to the manifest")
        covered = 0
        for record, row in zip(records, rows[1:]):
            if not any(row):
                continue
            ds = f[record["node"]]
            address, head = row[0], row[1]
            if address != h5py.h5o.get_info(ds.id).addr or raw[address:address + 4] != b"OHDR":
                raise SpecError(f"{record['node']}: the row's header address is not its own")
            parts = [raw[address:address + head]]
            for at, size in zip(row[2:6:2], row[3:6:2]):
                if size:
                    if raw[at:at + 4] != b"OCHK":
                        raise SpecError(f"{record['node']}: not a continuation chunk at {at}")
                    parts.append(raw[at:at + size])
            index, index_size, chunk, datatype, digest = row[6:]
            if raw[index:index + 4] != b"TREE" or index_size != 24 + 8 + 8 * (ds.ndim + 1) + 8:
                raise SpecError(f"{record['node']}: the row's chunk index")
            parts.append(raw[index:index + index_size])
            if crc32c(b"".join(parts)) != digest:
                raise SpecError(f"{record['node']}: the digest does not match the file")
            if chunk != ds.id.get_chunk_info(0).byte_offset:
                raise SpecError(f"{record['node']}: the row's chunk position")
            at, size = datatype & 0xFFFFFFFF, datatype >> 32 & 0xFFFF
            body = raw[address + at:address + at + size]
            if int.from_bytes(body[4:8], "little") != ds.id.get_type().get_size():
                raise SpecError(f"{record['node']}: the row's datatype message")
            covered += 1
        return covered


def _check_shards(name: str, attrs: dict, words: np.ndarray, stored: tuple[int, ...]) -> None:
    """6: shard records cover the stored shape once; each CRC taken unit by unit."""
    if "crc32c" in attrs:
        raise SpecError(f"{name}: a sharded tensor has no whole-tensor digest")
    covered = np.zeros(stored, np.int64)
    for rec in json.loads(attrs["shards"]):
        box = tuple(slice(o, o + n) for o, n in zip(rec["offsets"], rec["lengths"]))
        covered[box] += 1
        if crc_by_units(words[box], tuple(rec["unit"])) != rec["crc32c"]:
            raise SpecError(f"{name}: shard {rec} digest mismatch")
    if covered.size and not (covered == 1).all():
        raise SpecError(f"{name}: shards do not cover the tensor exactly once")


_SOURCE = re.compile(r"^/t(\d{6})-s(\d{5})$")
_SHARD_FILE = re.compile(r"^shard-(\d{5})-of-(\d{5})\.h5$")


def _check_hdf5_shard_files(directory: Path, ds: Any, entry: dict, fmt: Fmt,
                            words: np.ndarray, attrs: dict) -> None:
    """6.1: each virtual mapping is one box <- one whole shard dataset; read the shard file
    itself and check its chunk CRCs, its digest and that it holds the box's words."""
    import h5py

    records = json.loads(attrs["shards"])
    plist = ds.id.get_create_plist()
    for i in range(plist.get_virtual_count()):
        fname = plist.get_virtual_filename(i)
        dset = plist.get_virtual_dsetname(i)
        m, s = _SHARD_FILE.match(fname), _SOURCE.match(dset)
        if not m or not s or int(s.group(1)) != entry["index"]:
            raise SpecError(f"{entry['name']}: virtual source {fname}:{dset}")
        rec = records[int(s.group(2))]
        lo, hi = plist.get_virtual_vspace(i).get_select_bounds()
        if list(lo) != rec["offsets"] or [h - a + 1 for a, h in zip(lo, hi)] != rec["lengths"]:
            raise SpecError(f"{entry['name']}: mapping {i} is not its record's box")
        with h5py.File(directory / fname, "r") as g:
            root = _hdf5_attrs(g)
            if json.loads(root["lean_store_shard"])["rank"] != int(m.group(1)) or (
                root["complete"] != 1
            ):
                raise SpecError(f"{fname}: bad shard file root")
            src = g[dset.lstrip("/")]
            sattrs = _hdf5_attrs(src)
            block = _hdf5_words(src, fmt)
            table = list(np.asarray(sattrs["chunk_crc32c"]))
            if [crc_by_units(block[r], src.chunks)
                    for r in grid_regions(block.shape[: src.ndim], src.chunks)] != table:
                raise SpecError(f"{fname}:{dset}: chunk_crc32c mismatch")
            if crc32c(le_bytes(block)) != sattrs["crc32c"] or sattrs["crc32c"] != rec["crc32c"]:
                raise SpecError(f"{fname}:{dset}: digest mismatch")
            box = tuple(slice(o, o + n) for o, n in zip(rec["offsets"], rec["lengths"]))
            if not np.array_equal(block, words[box]):
                raise SpecError(f"{fname}:{dset}: differs from the master's view")


def nbit_unpack(data: bytes, count: int, widths: list[int]) -> np.ndarray:
    """1.6: HDF5 N-bit chunk bytes -> words (count × len(widths)), most significant bit first."""
    total = count * sum(widths)
    if len(data) < math.ceil(total / 8):
        raise SpecError("N-bit chunk too short")
    bits = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="big")[:total]
    out = np.zeros((count, len(widths)), np.uint64)
    at = 0
    per = bits.reshape(count, sum(widths))
    for j, w in enumerate(widths):
        for b in range(w):
            out[:, j] = (out[:, j] << np.uint64(1)) | per[:, at + b].astype(np.uint64)
        at += w
    return out


# ------------------------------------------------------------------------------ Zarr (2.6)


def _zarr_json(path: Path) -> dict:
    return json.loads(path.read_bytes())


def _zarr_chunk(raw: bytes, name: str) -> bytes:
    """2.6: a chunk is its bytes followed by their CRC-32C, 4 bytes little-endian."""
    body, tail = raw[:-4], raw[-4:]
    if int.from_bytes(tail, "little") != crc32c(body):
        raise SpecError(f"{name}: chunk crc32c mismatch")
    return body


def read_zarr(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of a Zarr checkpoint without compression, sharded arrays included."""
    root = Path(path)
    meta = _zarr_json(root / "zarr.json")
    attrs = meta["attributes"]
    layout = _root_checks(attrs, attrs.get("complete") is True)
    consolidated = meta.get("consolidated_metadata", {}).get("metadata", {})
    arrays = {p.name for p in root.iterdir() if p.is_dir()}
    out = {}
    for entry in layout:
        node = find_node(entry["name"], arrays)
        ameta = _zarr_json(root / node / "zarr.json")
        if consolidated and consolidated[node] != ameta:
            raise SpecError(f"{node}: consolidated metadata differs from the array's")
        fmt = _check_entry(entry, ameta["attributes"])
        native = ameta["attributes"]["storage"] == "native"
        dtype = np.dtype(_ZARR_NATIVE[ameta["data_type"]] if native else fmt.container)
        if not native and ameta["data_type"] != {1: "uint8", 2: "uint16", 4: "uint32",
                                                 8: "uint64"}[fmt.container.itemsize]:
            raise SpecError(f"{node}: raw words of the wrong type")
        shape = tuple(ameta["shape"])
        grid = tuple(ameta["chunk_grid"]["configuration"]["chunk_shape"])
        codecs = ameta["codecs"]
        arr = np.zeros(shape, dtype)
        encoding = ameta["chunk_key_encoding"]
        sep = encoding["configuration"]["separator"]
        if encoding["name"] != "default" or sep not in ("/", "."):
            raise SpecError(f"{node}: chunk key encoding {encoding}")
        for region in grid_regions(shape, grid):
            key = "c" + "".join(sep + str(s.start // g) for s, g in zip(region, grid))
            raw = (root / node / key).read_bytes()
            cell = tuple(g for g in grid)
            if codecs[0]["name"] == "sharding_indexed":
                valid = tuple(s.stop - s.start for s in region)
                arr[region] = _read_shard(raw, codecs[0]["configuration"], cell, valid, dtype,
                                          node)[tuple(slice(0, s.stop - s.start) for s in region)]
            else:
                assert [c["name"] for c in codecs] == ["bytes", "crc32c"], codecs
                body = _zarr_chunk(raw, node)
                arr[region] = np.frombuffer(body, dtype).reshape(cell)[
                    tuple(slice(0, s.stop - s.start) for s in region)]
        if "shards" in ameta["attributes"]:
            _check_shards(entry["name"], ameta["attributes"], arr, shape)
        elif crc32c(le_bytes(arr)) != ameta["attributes"]["crc32c"]:
            raise SpecError(f"{node}: digest mismatch")
        words = arr.view(fmt.container) if native else arr
        if native and fmt.kind == "complex":
            words = words.reshape(shape + (2,))
        n = len(entry["shape"])
        words = words.reshape(tuple(entry["shape"]) + words.shape[max(n, 1):])
        t = Tensor(entry["name"], fmt, tuple(entry["shape"]), words)
        _check_words(t)
        out[t.name] = t
    return out


def _read_shard(raw: bytes, config: dict, shard: tuple[int, ...], valid: tuple[int, ...],
                dtype: np.dtype, node: str) -> np.ndarray:
    """2.6: inner chunks, then (offset, nbytes) uint64 pairs per slot in C order, then the
    index's CRC-32C."""
    inner = tuple(config["chunk_shape"])
    assert [c["name"] for c in config["codecs"]] == ["bytes", "crc32c"], config["codecs"]
    assert config["index_location"] == "end"
    slots = [s // c for s, c in zip(shard, inner)]
    n = math.prod(slots)
    index_raw = _zarr_chunk(raw[-(16 * n + 4):], node + " shard index")
    index = np.frombuffer(index_raw, "<u8").reshape(n, 2)
    out = np.zeros(shard, dtype)
    for k, idx in enumerate(np.ndindex(*slots)):
        offset, nbytes = (int(v) for v in index[k])
        if offset == 2**64 - 1 and nbytes == 2**64 - 1:
            if all(i * c < v for i, c, v in zip(idx, inner, valid)):
                raise SpecError(f"{node}: inner chunk {idx} is missing")
            continue  # a slot wholly past the array's edge
        body = _zarr_chunk(raw[offset:offset + nbytes], node)
        box = tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, inner))
        out[box] = np.frombuffer(body, dtype).reshape(inner)
    return out
