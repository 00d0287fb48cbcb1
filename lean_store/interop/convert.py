"""Convert between lean_store (.h5, .zarr), safetensors, torch state dicts and TorchLean files.

Bits are exact in every direction: tensors move as raw words and are never cast. A tensor whose
format the target cannot hold (a 12-bit float into safetensors, bfloat16 into a TorchLean
float32 file, ...) is refused with a :class:`FormatError` naming every such tensor, before any
output exists. Outputs are written to a temporary sibling and renamed into place.

Formats (``--from`` / ``--to`` names, and the suffixes that imply them):

=================  ==========================  ===============================================
name               suffixes                    notes
=================  ==========================  ===============================================
hdf5               .h5 .hdf5 .hdf              lean_store; every format
zarr               .zarr                       lean_store; every format
safetensors        .safetensors                standard dtypes up to 8 bytes, complex64; as
                   .safetensors.index.json     input also a Hugging Face sharded checkpoint
                                               (its index, or the directory holding it)
torch              .pt .pth .bin               read with ``torch.load(weights_only=True)``; as
                   .bin.index.json             input also a Hugging Face sharded checkpoint
                                               of ``.bin`` files (its index, or directory)
torchlean-sf32     .tlsf32 .sf32               TLSF32B: float32 tensors only
torchlean-json     .json                       JSON state: one TorchLean format tag per file
torchlean-adam     .tladam                     TLADAMF optimizer state (versions 2-4)
=================  ==========================  ===============================================

Inputs are recognised by content first (HDF5 signature, Zarr group, ``TLSF32B``/``TLADAMF``
magic, zip or JSON), then by suffix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint import Checkpoint
from ..chunking import Region, region_shape, splits_into_row_blocks
from ..errors import CheckpointError, FormatError
from ..layout import Entry, Layout, stored_rank_shape
from ..sources.base import SourceTensor, TensorSource

FORMATS = (
    "hdf5", "zarr", "safetensors", "torch", "torchlean-sf32", "torchlean-json", "torchlean-adam",
)
SUFFIXES = {
    ".h5": "hdf5", ".hdf5": "hdf5", ".hdf": "hdf5", ".zarr": "zarr",
    ".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch",
    ".tlsf32": "torchlean-sf32", ".sf32": "torchlean-sf32", ".json": "torchlean-json",
    ".tladam": "torchlean-adam",
}
# Root attributes that carry what another format needs for a byte-identical way back.
PLAIN_DATA_ATTRS = ("training_format_version", "training", "optimizer", "dcp",
                    "lightning_format_version", "lightning")
"""The root attributes of a checkpoint's plain data (FORMAT.md 7: training checkpoints, also
those written before training_format_version with "optimizer", DCP's non-tensor items,
checkpoint dicts), carried between HDF5 and Zarr and dropped by ``tensors_only``."""
CARRIED_ATTRS = (
    "safetensors_metadata", "torch_metadata", "torch_archive", "torch_container", "torchlean_adam",
) + PLAIN_DATA_ATTRS


def format_of_path(path: str | os.PathLike, given: str | None = None, *, reading: bool) -> str:
    """The file format: ``given``, else from the content (when reading), else the suffix."""
    if given is not None:
        if given not in FORMATS:
            raise CheckpointError(f"unknown file format {given!r}; known: {', '.join(FORMATS)}")
        return given
    p = Path(path)
    if reading:
        from ..hardening import check_checkpoint_path

        check_checkpoint_path(p, what="input")  # missing; a FIFO or device, never opened
        from .foreign import index_of, model_file_of
        from .sharded_index import index_format

        index = index_of(p)
        if index is not None:  # a Hugging Face sharded checkpoint (or its directory)
            return index_format(index)
        single = model_file_of(p)  # a model directory of one weights file
        if single is not None:
            return format_of_path(single, reading=True)
        if p.is_dir():  # a Zarr store, or a sharded HDF5 checkpoint (lean_store.h5 + shards)
            from ..stores.registry import detect_backend

            return detect_backend(p)
        from ..stores.hdf5.checks import hdf5_superblock_offset
        from .foreign import file_kind

        if hdf5_superblock_offset(p) is not None:  # at 0 or after a user block
            return "hdf5"
        # by content: safetensors (also named .bin), a torch.save archive, TorchLean; a zip
        # archive of anything else (an .npz, a zipped Zarr store) is no torch file
        found = file_kind(p)
        if found is not None and found not in ("zip", "npz", "zarr-zip"):
            return found
    fmt = SUFFIXES.get(p.suffix.lower())
    if fmt is None:
        raise CheckpointError(
            f"cannot tell the file format of {str(p)!r} from its suffix; use one of "
            f"{', '.join(sorted(SUFFIXES))} or name the format ({', '.join(FORMATS)})"
        )
    return fmt


# ------------------------------------------------------------------------------ inputs


class _VerifiedTensor(SourceTensor):
    """Regions of a stored tensor. Read as one pass of equal row blocks from the origin (what
    the save pipeline does), they come from :meth:`Checkpoint.blocks`, so every chunk and the
    digest are checked on the way; any other order verifies the whole tensor once, first."""

    def __init__(self, ck: Checkpoint, entry: Entry) -> None:
        self._ck, self._entry = ck, entry
        self._shape = stored_rank_shape(entry)
        self._blocks: Iterator[tuple[Region, np.ndarray]] | None = None
        self._verified = False

    def read(self, region: Region) -> np.ndarray:
        name = self._entry.name
        if self._blocks is None and not self._verified:
            unit = region_shape(region)
            if all(s.start == 0 for s in region) and splits_into_row_blocks(self._shape, unit):
                self._blocks = self._ck.blocks(name, unit=unit)
            else:
                self._verify()
        if self._blocks is not None:
            got = next(self._blocks, None)
            if got is not None and _bounds(got[0]) == _bounds(region):
                if all(s.stop == d for s, d in zip(region, self._shape)):  # the last block
                    next(self._blocks, None)  # the digest is checked here
                    self._blocks, self._verified = None, True
                return got[1]
            self._blocks = None  # not one sequential pass after all
            self._verify()
        return self._ck.read_region(name, region)

    def _verify(self) -> None:
        self._ck.verify([self._entry.name])
        self._verified = True


def _bounds(region: Region) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in region)


class _CheckpointSource(TensorSource):
    def __init__(self, ck: Checkpoint) -> None:
        self._ck = ck
        self.layout = ck.layout

    def tensors(self) -> Iterator[tuple[Entry, SourceTensor]]:
        for entry in self.layout:
            yield entry, _VerifiedTensor(self._ck, entry)


class Input:
    """An opened input file: its layout, kind, carried attributes and a streaming source."""

    def __init__(
        self, fmt: str, source: TensorSource, *, kind: str = "state",
        extra: dict[str, Any] | None = None, closer: Callable[[], None] | None = None,
        read_words: Callable[[Entry], np.ndarray] | None = None,
    ) -> None:
        self.format = fmt
        self.source = source
        self.layout: Layout = source.layout
        self.kind = kind
        self.extra = dict(extra or {})
        self._closer = closer
        self._read_words = read_words
        self._tensors: dict[str, SourceTensor] | None = None

    def read_words(self, entry: Entry) -> np.ndarray:
        """The whole tensor's raw words, shaped ``entry.shape`` (+ ``(2,)`` for complex)."""
        pair = (2,) if entry.format.words_per_value == 2 else ()
        if self._read_words is not None:
            return self._read_words(entry).reshape(entry.shape + pair)
        if self._tensors is None:
            self._tensors = {e.name: t for e, t in self.source.tensors()}
        region = tuple(slice(0, d) for d in (entry.shape or (1,)))
        words = self._tensors[entry.name].read(region)
        return np.ascontiguousarray(words).reshape(entry.shape + pair)

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
            self._closer = None

    def __enter__(self) -> Input:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_input(path: str | os.PathLike, fmt: str | None = None) -> Input:
    """Open any supported file for conversion (lean_store inputs are fully validated)."""
    if not (isinstance(path, str) and "://" in path):
        from ..hardening import check_checkpoint_path

        check_checkpoint_path(path, what="input")  # a FIFO or device is never opened
    if not (isinstance(path, str) and "://" in path):
        from .foreign import model_file_of

        path = model_file_of(path) or path  # a model directory: its one weights file
    fmt = format_of_path(path, fmt, reading=True)
    if fmt in ("hdf5", "zarr"):
        ck = Checkpoint(path, backend=fmt)
        extra = {k: ck.root_attrs[k] for k in CARRIED_ATTRS if k in ck.root_attrs}
        return Input(fmt, _CheckpointSource(ck), kind=ck.kind, extra=extra, closer=ck.close,
                     read_words=lambda entry: ck.read_bits(entry.name))
    if fmt in ("safetensors", "torch"):
        from .foreign import index_of
        from .sharded_index import ShardedIndexSource

        index = index_of(path)
        if index is not None:
            sharded = ShardedIndexSource(index)
            if sharded.format != fmt:
                sharded.close()
                raise CheckpointError(f"{index} is an index of {sharded.format} shards, "
                                      f"not of {fmt} files")
            return Input(fmt, sharded, extra=sharded.extra, closer=sharded.close,
                         read_words=sharded.words)
    if fmt == "safetensors":
        from .safetensors_io import SafetensorsSource

        st = SafetensorsSource(path)
        return Input(fmt, st, extra=st.extra, closer=st.close, read_words=st.words)
    if fmt == "torch":
        from .torch_io import TorchFileSource

        tf = TorchFileSource(path)
        return Input(fmt, tf, extra=tf.extra)
    from ..sources import tensor_source
    from . import torchlean_bridge as tl

    if fmt == "torchlean-sf32":
        return Input(fmt, tensor_source(tl.state_from_sf32(path)))
    if fmt == "torchlean-json":
        with open(path, "rb") as f:
            return Input(fmt, tensor_source(tl.state_from_json(f.read())))
    state, attrs = tl.adam_state(tl.read_adam(path))
    return Input(fmt, tensor_source(state), kind="optimizer", extra=attrs)


# ------------------------------------------------------------------------------ outputs


_PLAIN_DATA = (
    ("training", "a training checkpoint's step, optimizer hyperparameters, scheduler, RNG and "
                 "trainer state"),
    ("optimizer", "an optimizer's hyperparameters and state layout"),
    ("dcp", "DCP's non-tensor items"),
)


def _holds_plain_data(extra: dict[str, Any], key: str) -> bool:
    """True when root attribute ``key`` carries data a tensor-only format would drop (DCP's
    attribute of a save without non-tensor items carries none)."""
    if key not in extra:
        return False
    if key != "dcp":
        return True
    try:
        return bool(json.loads(extra[key]).get("objects"))
    except (ValueError, AttributeError, TypeError):
        return True


def refusals(inp: Input, fmt: str) -> list[str]:
    """Why ``inp`` cannot be written exactly as ``fmt`` (one line each), or []."""
    from . import torchlean_bridge as tl

    layout = inp.layout
    if "lightning" in inp.extra and fmt not in ("hdf5", "zarr", "torch"):
        return [f"the input is a checkpoint dict (plain data such as epochs or hyperparameters "
                f"besides its tensors), which {fmt} cannot hold; convert it to .h5, .zarr or "
                ".pt, or pass tensors_only (lean-store convert --tensors-only)"]
    lost = [what for key, what in _PLAIN_DATA if _holds_plain_data(inp.extra, key)]
    if lost and fmt not in ("hdf5", "zarr"):
        return [f"the input holds {' and '.join(lost)} besides its tensors, which {fmt} cannot "
                "hold (tensors only) and a conversion would drop; convert it to .h5 or .zarr, "
                "or pass tensors_only (lean-store convert --tensors-only) to write the tensors "
                "alone"]
    if fmt == "safetensors":
        from .safetensors_io import unrepresentable

        return unrepresentable(layout)
    if fmt == "torch":
        from .torch_io import unrepresentable as torch_unrepresentable

        return torch_unrepresentable(layout)
    if fmt == "torchlean-sf32":
        return tl.sf32_unrepresentable(layout)
    if fmt == "torchlean-json":
        return tl.json_unrepresentable(layout)
    if fmt == "torchlean-adam" and tl.ADAM_ATTR not in inp.extra:
        return ["only a TorchLean Adam state (imported from a TLADAMF file) can be written as one"]
    return []


def write_output(
    inp: Input, path: str | os.PathLike, fmt: str | None = None, *, compression: Any = None,
    chunk_bytes: int | None = None, progress: Any = False,
) -> str:
    """Write ``inp`` to ``path`` as ``fmt`` (default: from the suffix). Returns the format."""
    fmt = format_of_path(path, fmt, reading=False)
    problems = refusals(inp, fmt)
    if problems:
        raise FormatError(
            f"{fmt} cannot hold this {inp.format} input exactly (lean_store never casts):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    if fmt in ("hdf5", "zarr"):
        from ..writing import write_source

        write_source(inp.source, path, kind=inp.kind, backend=fmt, chunk_bytes=chunk_bytes,
                     compression=compression, progress=progress, extra_root=inp.extra)
        return fmt
    if compression is not None:
        raise CheckpointError(f"compression applies to hdf5 and zarr outputs, not {fmt}")
    from . import torchlean_bridge as tl

    if fmt == "safetensors":
        from ..progress import make_progress
        from .safetensors_io import write_safetensors

        text = inp.extra.get("safetensors_metadata")
        # a safetensors file's own metadata (or its absence) as it was; else what Hugging Face
        # writes and its from_pretrained expects of a PyTorch state
        metadata = json.loads(text) if isinstance(text, str) else DEFAULT_SAFETENSORS_METADATA
        with make_progress(progress, f"write {Path(path).name}", inp.layout.nbytes) as bar:
            write_safetensors(inp.source, path, metadata=metadata, progress=bar)
    elif fmt == "torch" and "lightning" in inp.extra:
        from .torch_io import write_torch_dict

        write_torch_dict(inp.extra["lightning"], inp.layout, inp.read_words, path)
    elif fmt == "torch":
        from .torch_io import write_torch

        text = inp.extra.get("torch_metadata")
        write_torch(inp.layout, inp.read_words, path,
                    metadata=json.loads(text) if isinstance(text, str) else None,
                    archive=inp.extra.get("torch_archive"),
                    container=inp.extra.get("torch_container"))
    elif fmt == "torchlean-sf32":
        tl.write_sf32_from(inp.layout, inp.read_words, path)
    elif fmt == "torchlean-json":
        from .torchlean import write_state_json

        write_state_json(path, tl.state_json_of(inp.layout, inp.read_words))
    else:
        tl.write_adam_from(inp.layout, inp.read_words, inp.extra, path)
    return fmt


DEFAULT_SAFETENSORS_METADATA = {"format": "pt"}
"""``__metadata__`` of a safetensors file converted from anything but a safetensors file:
transformers' ``save_pretrained`` writes it, and ``from_pretrained`` of older releases (and its
Flax loader) refuses files whose metadata lacks a known ``format``."""


def convert(
    src: str | os.PathLike, dst: str | os.PathLike, *, src_format: str | None = None,
    dst_format: str | None = None, compression: Any = None, chunk_bytes: int | None = None,
    progress: Any = False, tensors_only: bool = False,
) -> Layout:
    """Convert ``src`` to ``dst`` exactly; returns the layout converted. ``tensors_only``
    drops the plain data (a training checkpoint's step and hyperparameters, a checkpoint
    dict's epochs, DCP's non-tensor items) and writes the tensors as a plain state, which
    formats of tensors alone (safetensors, torch) then take."""
    if os.path.abspath(src) == os.path.abspath(dst):
        raise CheckpointError("the source and destination are the same path")
    with open_input(src, src_format) as inp:
        if tensors_only:
            inp.extra = {k: v for k, v in inp.extra.items() if k not in PLAIN_DATA_ATTRS}
            inp.kind = "state"
        write_output(inp, dst, dst_format, compression=compression, chunk_bytes=chunk_bytes,
                     progress=progress)
        return inp.layout


__all__ = [
    "CARRIED_ATTRS", "FORMATS", "PLAIN_DATA_ATTRS", "Input", "SUFFIXES", "convert",
    "format_of_path", "open_input", "refusals", "write_output",
]
