"""What a path that holds no lean_store checkpoint holds instead, for the error refusing it.

``ls.load(model, "model.safetensors")``, ``ls.load_state("m.pt")`` or ``ls.open`` of a zipped
Zarr store are refused (lean_store reads its own checkpoints only); the refusal names what the
file is and the way to it: ``lean-store convert`` for the formats it converts, a
``zarr.storage.ZipStore`` for a zipped Zarr store, ``numpy.load`` for an ``.npz`` archive. Only
the file's first bytes, or a zip archive's list of members, are read: nothing is parsed or
unpickled. The content tests of other formats live here (``convert`` recognises its inputs with
them), free of the readers and writers, which the store layer must not import.
"""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path

from ..errors import CheckpointError
from .torchlean import ADAM_MAGIC, SF32_MAGIC

MAX_HEADER_BYTES = 100_000_000  # the limit the safetensors library enforces
INDEX_SUFFIX = ".safetensors.index.json"
TORCH_INDEX_SUFFIX = ".bin.index.json"


def looks_like_safetensors(head: bytes) -> bool:
    """An 8-byte little-endian header length within safetensors' limit, then a JSON object."""
    if len(head) < 10:
        return False
    (n,) = struct.unpack_from("<Q", head)
    return 2 <= n <= MAX_HEADER_BYTES and head[8:9] == b"{"


def torchlean_kind(path: str | os.PathLike) -> str | None:
    """``torchlean-sf32``, ``torchlean-adam`` or ``torchlean-json`` from a file's first bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return None
    if head.startswith(SF32_MAGIC):
        return "torchlean-sf32"
    if head.startswith(ADAM_MAGIC):
        return "torchlean-adam"
    if head.lstrip().startswith(b"{") and b'"format"' in head:
        return "torchlean-json"
    return None


def index_of(path: str | os.PathLike) -> Path | None:
    """The index ``path`` names: the file itself (``*.safetensors.index.json`` or
    ``*.bin.index.json``), or the one index in a directory that is not a Zarr store (its
    safetensors index where it has both kinds); None otherwise."""
    p = Path(path)
    if p.is_file() and p.name.endswith((INDEX_SUFFIX, TORCH_INDEX_SUFFIX)):
        return p
    if p.is_dir() and not (p / "zarr.json").exists():
        for suffix, kind in ((INDEX_SUFFIX, "safetensors"), (TORCH_INDEX_SUFFIX, "torch .bin")):
            found = sorted(q for q in p.glob(f"*{suffix}") if q.is_file())
            if len(found) > 1:
                raise CheckpointError(f"{p} holds {len(found)} {kind} indexes "
                                      f"({', '.join(q.name for q in found)}): name the one "
                                      "to read")
            if found:
                return found[0]
    return None


def model_file_of(path: str | os.PathLike) -> Path | None:
    """The one weights file of a model directory without an index (most models: one
    ``model.safetensors`` below transformers' 5 GB shard size), else None: its only
    ``*.safetensors`` file, or else its ``pytorch_model.bin``. Files may be symbolic links
    to regular files, as in the Hugging Face hub's cache (``snapshots/<revision>/``)."""
    p = Path(path)
    if not p.is_dir() or (p / "zarr.json").exists() or index_of(p) is not None:
        return None
    found = sorted(q for q in p.glob("*.safetensors") if q.is_file())
    if len(found) > 1:
        raise CheckpointError(f"{p} holds {len(found)} safetensors files and no index "
                              f"({', '.join(q.name for q in found[:5])}"
                              f"{' ...' if len(found) > 5 else ''}): name the one to read")
    if found:
        return found[0]
    legacy = p / "pytorch_model.bin"
    return legacy if legacy.is_file() else None


_ZIP_MEMBERS = 100_000  # members of a zip archive looked at, at most
_HEAD = 64


def zip_kind(path: str | os.PathLike) -> str | None:
    """``"torch"`` (a ``torch.save`` archive: a ``.../data.pkl`` member), ``"zarr-zip"`` (a
    zipped Zarr store: a ``zarr.json`` at its top or one folder down), ``"npz"`` (numpy's:
    every member a ``.npy``), ``"zip"`` (any other zip archive), or None (no zip archive)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [info.filename for info, _ in zip(archive.infolist(), range(_ZIP_MEMBERS))]
    except (OSError, zipfile.BadZipFile, ValueError, EOFError):
        return None
    if any(name.endswith("/data.pkl") for name in names):
        return "torch"
    if any(name == "zarr.json" or (name.endswith("/zarr.json") and name.count("/") == 1)
           for name in names):
        return "zarr-zip"
    if names and all(name.endswith(".npy") for name in names):
        return "npz"
    return "zip"


def file_kind(path: str | os.PathLike) -> str | None:
    """What the regular file ``path`` is, when it is a format users bring to lean_store:
    ``"safetensors"``, ``"torch"``, ``"zarr-zip"``, ``"npz"``, ``"zip"``, a TorchLean file
    (:func:`torchlean_kind`), or None."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            head = f.read(_HEAD)
    except OSError:
        return None
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return zip_kind(p)
    if looks_like_safetensors(head):
        return "safetensors"
    found = torchlean_kind(p)
    if found is not None and (found != "torchlean-json" or p.suffix.lower() == ".json"):
        return found
    if head.startswith(b"\x80") and p.suffix.lower() in (".pt", ".pth", ".bin", ".ckpt"):
        return "torch"  # torch.save's legacy (pickle) format
    return None


def refusal_hint(path: str | os.PathLike) -> str:
    """A sentence for the error refusing ``path`` as a checkpoint: what it holds and the way
    to use it with lean_store; "" when it is nothing lean_store knows."""
    p = Path(path)
    try:
        if p.is_dir():
            return _directory_hint(p)
        kind = file_kind(p)
    except OSError:
        return ""
    if kind is None or kind == "zip":
        return ""
    if kind == "zarr-zip":
        return (f"; it is a zipped Zarr store: pass zarr.storage.ZipStore({str(p)!r}, "
                "mode='r') in place of the path (lean_store reads and checks it as it reads "
                "the directory), or unzip it")
    if kind == "npz":
        return ("; it is a numpy .npz archive: numpy.load() it and ls.save() the dict of "
                "arrays")
    what = {"torch": "a torch.save file", "safetensors": "a safetensors file"}.get(
        kind, f"a {kind} file")
    how = " (exact bits; read with torch.load(weights_only=True): no pickled code runs)" \
        if kind == "torch" else " (exact bits)"
    return f"; it is {what}: 'lean-store convert {p} OUT.h5' makes a checkpoint of it{how}"


def _directory_hint(directory: Path) -> str:
    """For a directory: the model weights it holds (a Hugging Face model directory), or a
    checkpoint torch.distributed.checkpoint wrote with its own ``FileSystemWriter``."""
    if (directory / ".metadata").is_file() and next(directory.glob("*.distcp"), None):
        return ("; it is a torch.distributed.checkpoint (DCP) directory: dcp.load it (any "
                "world size) and ls.save the state, or torch.distributed.checkpoint."
                f"format_utils.dcp_to_torch_save({str(directory)!r}, 'state.pt') and then "
                "'lean-store convert state.pt OUT.h5' (DCP's .metadata is a pickle: only for "
                "checkpoints you trust); lean_store.interop.dcp makes dcp.save write "
                "lean_store checkpoints")
    try:
        found = index_of(directory) or model_file_of(directory)
    except CheckpointError:
        return ""
    if found is None:
        return ""
    return (f"; it holds model weights ({found.name}): 'lean-store convert {directory} "
            "OUT.h5' makes one checkpoint of them (exact bits)")


__all__ = ["INDEX_SUFFIX", "MAX_HEADER_BYTES", "TORCH_INDEX_SUFFIX", "file_kind", "index_of",
           "looks_like_safetensors", "model_file_of", "refusal_hint", "torchlean_kind", "zip_kind"]
