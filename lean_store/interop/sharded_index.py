"""A Hugging Face sharded checkpoint (safetensors or torch ``.bin`` shards) as one input.

``save_pretrained`` writes a model larger than its shard size as several files and an index
beside them, ``model.safetensors.index.json`` (or, for the ``.bin`` files transformers wrote
before safetensors, and which many published models still ship, ``pytorch_model.bin.index.json``)::

    {"metadata": {"total_size": ...},
     "weight_map": {"<tensor>": "model-00001-of-00002.safetensors", ...}}

:class:`ShardedIndexSource` reads the index and every shard file it names as one state
(``lean-store convert <index or its directory> out.h5``): safetensors shards memory-mapped,
``.bin`` shards with ``torch.load(weights_only=True)``. The index and the files must agree
exactly: every tensor the index maps is in its file, no file holds a tensor the index does not
map to it, and shard names are plain file names in the index's directory (never a path that
leads elsewhere). Any disagreement is one :class:`IntegrityError` listing every difference,
before anything is written. Tensors keep the shards' order, each file's in data order. A
directory holding both kinds of index (the same weights, as many model repositories ship them)
is read through its safetensors index, as transformers reads it. A directory without an index
stands for its one weights file (:func:`.foreign.model_file_of`). Shards and files may be symbolic
links to regular files, as everything in the Hugging Face hub's cache is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, IntegrityError, UnsafeFileError
from ..hardening import check_json_depth
from ..layout import Entry, Layout
from ..sources.base import SourceTensor, TensorSource
from .foreign import INDEX_SUFFIX
from .safetensors_io import SafetensorsSource

MAX_INDEX_BYTES = 64 << 20  # an index of a million tensors is ~80 MB; today's largest ~2 MB
_LISTED = 8  # differences named in one error


def index_format(index: Path) -> str:
    """``"safetensors"`` or ``"torch"``: the kind of shard files ``index`` names."""
    return "safetensors" if index.name.endswith(INDEX_SUFFIX) else "torch"


def _read_index(index: Path) -> tuple[dict[str, str], Any]:
    try:
        size = index.stat().st_size
        if size > MAX_INDEX_BYTES:
            raise UnsafeFileError(f"{index}: {size} bytes is too large for an index of shards")
        raw = index.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read {index}: {exc.strerror or exc}") from None
    check_json_depth(raw, str(index))
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise IntegrityError(f"{index}: not a valid JSON index of shards ({exc})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise IntegrityError(f"{index}: an index of shards needs a non-empty weight_map of "
                             "tensor names to shard file names")
    for name in set(weight_map.values()):
        if name in ("", ".", "..") or Path(name).name != name or "\\" in name or "\0" in name:
            raise UnsafeFileError(f"{index}: shard {name!r} is not a file name in the index's "
                                  "directory")
    return weight_map, doc.get("metadata")


class ShardedIndexSource(TensorSource):
    """The tensors of every shard an index names (safetensors files as exact raw words,
    memory-mapped; torch ``.bin`` files as ``torch.load(weights_only=True)`` gives them).

    ``metadata`` is the safetensors shards' common ``__metadata__`` (None when they differ or
    have none, and for ``.bin`` shards), ``index_metadata`` the index's own ``metadata``."""

    kind = "state"

    def __init__(self, index: str | os.PathLike) -> None:
        self.path = Path(index)
        self.format = index_format(self.path)
        weight_map, self.index_metadata = _read_index(self.path)
        self._shards: dict[str, Any] = {}
        try:
            problems: list[str] = []
            for file in sorted(set(weight_map.values())):
                shard = self.path.parent / file
                if not shard.is_file():  # a symbolic link to one counts (the hub's cache)
                    problems.append(f"shard {file!r} is not a file beside the index")
                    continue
                self._shards[file] = self._open_shard(shard)
            self._owner: dict[str, str] = {}
            self._tensors: dict[str, SourceTensor] = {}
            specs = []
            for file, source in self._shards.items():
                mapped = {n for n, f in weight_map.items() if f == file}
                held = set(source.layout.names())
                problems += [f"{n!r} is mapped to {file!r}, which does not hold it"
                             for n in sorted(mapped - held)]
                problems += [f"{file!r} holds {n!r}, which the index " + (
                    f"maps to {weight_map[n]!r}" if n in weight_map else "does not list")
                    for n in sorted(held - mapped)]
                for entry, tensor in source.tensors():
                    if entry.name in mapped:
                        self._owner[entry.name] = file
                        self._tensors[entry.name] = tensor
                        specs.append((entry.name, entry.shape, entry.format))
            if problems:
                shown = "\n".join(f"  - {p}" for p in problems[:_LISTED])
                more = f"\n  ... and {len(problems) - _LISTED} more" \
                    if len(problems) > _LISTED else ""
                raise IntegrityError(f"{self.path}: the index and its shard files disagree "
                                     f"({len(problems)}):\n{shown}{more}")
            self.layout = Layout.from_specs(specs)
        except BaseException:
            self.close()
            raise
        self.metadata = None
        if self.format == "safetensors":
            kinds = {json.dumps(s.metadata, sort_keys=True) for s in self._shards.values()}
            if len(kinds) == 1:
                self.metadata = next(iter(self._shards.values())).metadata
            self.extra = {"safetensors_metadata": json.dumps(self.metadata)}
        else:
            self.extra = {}

    def _open_shard(self, shard: Path) -> Any:
        if self.format == "safetensors":
            return SafetensorsSource(shard)
        from .torch_io import TorchFileSource

        return TorchFileSource(shard)

    def words(self, entry: Entry) -> np.ndarray:
        """The tensor's whole raw words (a view of the mapped file for safetensors)."""
        shard = self._shards[self._owner[entry.name]]
        if isinstance(shard, SafetensorsSource):
            return shard.words(shard.layout[entry.name])
        return self._tensors[entry.name].read(tuple(slice(0, d) for d in (entry.shape or (1,))))

    def tensors(self) -> Iterator[tuple[Entry, SourceTensor]]:
        for entry in self.layout:
            yield entry, self._tensors[entry.name]

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()
