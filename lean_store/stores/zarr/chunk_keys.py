"""The chunk key encoding of the Zarr arrays lean_store writes, and the separator of an array's
own document. Spec only (Zarr v3 ``chunk_key_encoding``), no zarr-python: the incremental
linker, imported with ``lean_store``, needs it without loading zarr."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# ``c.0.0`` in the array's own folder (one folder per array) instead of zarr's default
# ``c/0/0`` (one folder per axis more, each a ``mkdir`` on save and a listing on load). Both
# are the spec's default chunk key encoding; checkpoints written with "/" are read as before.
KEY_SEPARATOR = "."
KEY_SEPARATORS = ("/", ".")  # the direct layout's readers take either
CHUNK_KEY_ENCODING: dict[str, Any] = {"name": "default", "separator": KEY_SEPARATOR}  # zarr


def key_separator(doc: Any) -> str | None:
    """The separator of ``doc``'s ``default`` chunk key encoding when it is one the direct
    layout's readers and writers take (:data:`KEY_SEPARATORS`), else None."""
    encoding = doc.get("chunk_key_encoding") if isinstance(doc, dict) else None
    if not isinstance(encoding, dict) or encoding.get("name") != "default":
        return None
    config = encoding.get("configuration")
    separator = config.get("separator") if isinstance(config, dict) else None
    return separator if isinstance(separator, str) and separator in KEY_SEPARATORS else None


def default_chunk_key(separator: str, coords: Iterable[int | str]) -> str:
    """The key (relative to the array) of the chunk at grid ``coords`` in the ``default``
    chunk key encoding with ``separator``: ``c.0.1`` (``c`` alone for no axes)."""
    return "c" + "".join(separator + str(c) for c in coords)


__all__ = ["CHUNK_KEY_ENCODING", "KEY_SEPARATOR", "KEY_SEPARATORS", "default_chunk_key",
           "key_separator"]
