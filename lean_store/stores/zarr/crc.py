"""A faster encoder for Zarr v3's ``crc32c`` codec, with the same bytes on disk.

The codec lives in :mod:`lean_store.stores.zarr.compat` (it overrides a private zarr method, so it
sits with the other version-dependent code, which falls back to the stock codec where the
installed zarr lacks the hook); this module keeps the name importable.
"""

from __future__ import annotations

from .compat import LeanCrc32cCodec, crc32c_codec

__all__ = ["LeanCrc32cCodec", "crc32c_codec"]
