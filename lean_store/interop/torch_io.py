"""torch ``.pt`` / ``.pth`` / ``.bin`` state-dict files, read ONLY with ``weights_only=True``.

Reading never runs arbitrary pickle code: ``torch.load(weights_only=True)`` accepts tensors,
plain containers and primitive values only. The file holds a flat mapping of names to
tensors (a ``state_dict``), or a checkpoint dict of tensors and plain data (``{"model": ...,
"optimizer": ..., "epoch": 3}``, a Lightning ``.ckpt``), stored as :mod:`.checkpoint_dict`
lays it out. Writing uses ``torch.save`` on an ``OrderedDict`` in layout order (a checkpoint
dict: the dict again).

For a byte-identical round trip, the state dict's ``_metadata`` (module versions) and the zip
archive's record prefix (torch derives it from the file name it saved to) and the container
type (dict or OrderedDict) are kept in the lean_store root attributes ``torch_metadata``,
``torch_archive`` and ``torch_container``, and reproduced on export.
Tensors that shared one storage in the original file (tied weights, views) are written as
separate storages, so such files convert exactly in values but not byte for byte.

torch is imported inside the functions, so ``lean_store.interop`` imports without torch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, FormatError, IntegrityError
from ..layout import Layout
from ..sources.base import TensorSource
from ..stores.commit import Commit
from ..stores.target import FileKind

_ARCHIVE = re.compile(r"[A-Za-z0-9_\-]{1,200}")
_ZIP_LOCAL_HEADER = b"PK\x03\x04"
# what torch.save's legacy (pre-zip) format starts with: pickle protocol 2 of its magic number
_LEGACY_MAGIC = b"\x80\x02\x8a\n" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def _looks_like_torch_save(head: bytes) -> bool:
    """A zip whose first record is ``<archive>/data.pkl`` (torch.save's format since 1.6), or
    torch.save's legacy pickle format."""
    if head.startswith(_LEGACY_MAGIC):
        return True
    if len(head) < 30 or not head.startswith(_ZIP_LOCAL_HEADER):
        return False
    (name_length,) = struct.unpack_from("<H", head, 26)
    return head[30:30 + name_length].endswith(b"/data.pkl")


TORCH_FILE = FileKind("a torch.save file", _looks_like_torch_save)


def load_state_dict(path: str | os.PathLike) -> Any:
    """``torch.load(path, weights_only=True, map_location="cpu")``: a flat name -> tensor map."""
    obj = load_object(path)
    _check_flat(path, obj)
    return obj


def _check_flat(path: str | os.PathLike, obj: Any) -> None:
    import torch

    if not isinstance(obj, dict):
        raise FormatError(f"{path}: holds a {type(obj).__name__}, not a state dict of tensors")
    bad = [str(k) for k, v in obj.items() if not isinstance(k, str) or not torch.is_tensor(v)]
    if bad:
        raise FormatError(
            f"{path}: not a flat state dict of tensors; entries that are not named tensors: "
            f"{bad[:10]}{' ...' if len(bad) > 10 else ''}"
        )


def _is_flat(obj: Any) -> bool:
    import torch

    return isinstance(obj, dict) and all(isinstance(k, str) and torch.is_tensor(v)
                                         for k, v in obj.items())


def load_object(path: str | os.PathLike) -> Any:
    """``torch.load(path, weights_only=True, map_location="cpu")``, memory-mapped where the
    file allows; anything it refuses is an :class:`IntegrityError`."""
    import torch

    try:
        try:
            obj = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
        except RuntimeError as exc:  # legacy (non-zip) files cannot be memory-mapped
            if "mmap" not in str(exc) and "zip" not in str(exc):
                raise
            obj = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - torch raises many types; all mean "not loadable"
        raise IntegrityError(_refusal(path, exc)) from None
    return obj


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def _refusal(path: str | os.PathLike, exc: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` refused ``path``, in one line: the class a pickled
    object needs (a whole ``nn.Module``, a custom or numpy object) and what to do if the file
    is trusted; else the first line of torch's message, without its terminal colours."""
    text = _ANSI.sub("", str(exc)).strip()
    found = _GLOBAL.search(text)
    if found is not None:
        return (f"{path}: holds a pickled {found.group(1)}, which torch.load(weights_only=True) "
                "does not rebuild (unpickling it could run code; lean_store never loads "
                "arbitrary pickles). If you trust the file, load it yourself (torch.load "
                "with weights_only=False) and save its tensors (a module's state_dict()) "
                "with lean_store.save")
    detail = text.split("WeightsUnpickler error:", 1)[-1].strip()  # what it stumbled on
    first = detail.splitlines()[0] if detail else type(exc).__name__
    return (f"{path}: torch.load(weights_only=True) refused it ({type(exc).__name__}: {first}). "
            "lean_store never loads arbitrary pickles.")


def archive_name(path: str | os.PathLike) -> str | None:
    """The record prefix of a torch zip file (``archive`` when saved to a file object)."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError):
        return None
    prefix = names[0].split("/", 1)[0] if names else ""
    return prefix if _ARCHIVE.fullmatch(prefix) else None


class TorchFileSource(TensorSource):
    """The tensors of a torch state-dict file, in the file's order; or of a checkpoint dict
    (``{"model": ..., "optimizer": ..., "epoch": 3}``, a Lightning ``.ckpt``), named by key
    path, with its plain data as the root attributes of :mod:`.checkpoint_dict`."""

    kind = "state"

    def __init__(self, path: str | os.PathLike) -> None:
        from ..sources.torch_source import TorchSource

        self.path = Path(path)
        obj = load_object(path)
        self.extra: dict[str, Any] = {}
        if isinstance(obj, dict) and obj and not _is_flat(obj):
            self._inner = self._checkpoint_dict(obj)
            self.layout = self._inner.layout
            return
        _check_flat(path, obj)
        state = obj
        try:
            self._inner = TorchSource(state)
        except CheckpointError as exc:
            raise FormatError(f"{path}: {exc}") from None
        self.layout = self._inner.layout
        meta = getattr(state, "_metadata", None)
        if meta is not None:
            try:
                self.extra["torch_metadata"] = json.dumps(meta)
            except (TypeError, ValueError):
                pass  # not JSON-able: dropped (values are unaffected)
        archive = archive_name(path)
        if archive is not None:
            self.extra["torch_archive"] = archive
        self.extra["torch_container"] = "OrderedDict" if isinstance(state, OrderedDict) else "dict"

    def _checkpoint_dict(self, obj: dict[Any, Any]) -> TensorSource:
        """A checkpoint dict: its tensors by key path, its plain data as JSON."""
        from ..sources.torch_source import TorchSource
        from .checkpoint_dict import (
            LIGHTNING_FORMAT_VERSION,
            META_ATTR,
            VERSION_ATTR,
            metadata_text,
        )

        tensors: dict[str, Any] = {}
        try:
            text = metadata_text(obj, tensors)
            source = TorchSource(tensors)
        except CheckpointError as exc:
            raise FormatError(f"{self.path}: a checkpoint dict lean_store cannot store: {exc}"
                              ) from None
        self.extra = {VERSION_ATTR: LIGHTNING_FORMAT_VERSION, META_ATTR: text}
        return source

    def tensors(self) -> Any:
        return self._inner.tensors()

    def close(self) -> None:
        pass


def unrepresentable(layout: Layout) -> list[str]:
    """One line per tensor whose format has no torch dtype."""
    from ..sources.torch_source import dtype_of_format

    return [
        f"{e.name!r}: {e.format.tag} ({e.format.width} bits) has no torch dtype"
        for e in layout
        if dtype_of_format(e.format) is None
    ]


def write_torch_dict(meta_text: str, layout: Layout, read_words: Any,
                     path: str | os.PathLike) -> None:
    """``torch.save`` the checkpoint dict whose plain data is ``meta_text`` (the root attribute
    of :mod:`.checkpoint_dict`) and whose tensors are ``layout``'s, atomically, as
    :func:`write_torch` saves a state dict."""
    import torch

    from .checkpoint_dict import decode_tensors, parse_metadata

    problems = unrepresentable(layout)
    if problems:
        raise FormatError(
            "torch cannot hold these tensors exactly (lean_store never casts):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    meta = parse_metadata(meta_text, "the checkpoint dict's JSON")
    obj = decode_tensors(meta, layout, read_words, None, "checkpoint dict")
    with Commit.local(path, directory=False, kind=TORCH_FILE) as commit:
        with open(commit.work, "wb") as f:
            torch.save(obj, f)
        commit.commit()


def write_torch(
    layout: Layout,
    read_words: Any,
    path: str | os.PathLike,
    *,
    metadata: dict | None = None,
    archive: str | None = None,
    container: str | None = None,
) -> None:
    """``torch.save`` an OrderedDict of exact tensors, atomically (a :class:`Commit`: a
    temporary sibling, fsynced, renamed into place, then the directory fsynced). Only a
    torch.save file is replaced: a directory, a link or another kind of file at ``path`` raises
    :class:`~lean_store.errors.ForeignPathError` and is left untouched.

    ``read_words(entry)`` returns the whole tensor's raw words. ``metadata`` becomes the state
    dict's ``_metadata``; ``archive`` the zip record prefix (default ``archive``);
    ``container`` ``"dict"`` saves a plain dict instead of an OrderedDict.
    """
    import torch

    from ..sources.torch_source import new_tensor

    problems = unrepresentable(layout)
    if problems:
        raise FormatError(
            "torch cannot hold these tensors exactly (lean_store never casts):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    state: OrderedDict[str, Any] = OrderedDict()
    for entry in layout:
        words = np.ascontiguousarray(read_words(entry))
        if not words.flags.writeable:  # e.g. a memory-mapped input; torch wants writable memory
            words = words.copy()
        tensor = new_tensor(words, entry.format, entry.shape, None)
        if tensor.numel() == 0:  # give empty tensors the standard strides torch.save records
            tensor = torch.empty(entry.shape, dtype=tensor.dtype)
        state[entry.name] = tensor
    if metadata is not None:
        state._metadata = OrderedDict(metadata)  # type: ignore[attr-defined]
    obj: Any = dict(state) if container == "dict" and metadata is None else state
    if archive is not None and not _ARCHIVE.fullmatch(archive):
        archive = None
    with Commit.local(path, directory=False, kind=TORCH_FILE) as commit:
        if archive is None or archive == "archive":
            with open(commit.work, "wb") as f:  # a file object: torch names records "archive/"
                torch.save(obj, f)
        else:  # torch names the records after the file name's stem: save under that name
            work = Path(commit.work)
            scratch = Path(tempfile.mkdtemp(prefix=f"{work.name}.", dir=work.parent))
            try:
                torch.save(obj, str(scratch / archive))
                os.replace(scratch / archive, work)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        commit.commit()


__all__ = [
    "TORCH_FILE", "TorchFileSource", "archive_name", "load_object", "load_state_dict",
    "unrepresentable", "write_torch", "write_torch_dict",
]
