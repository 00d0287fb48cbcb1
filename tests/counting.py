"""Byte counters for partial-read tests: a file object HDF5 reads through, and a zarr
LocalStore. Both route reads around lean_store's default fast paths (HDF5's sec2 pread, Zarr's
direct chunk reads); tests/stores/test_fast_path_reads.py counts those."""

from __future__ import annotations

import io

from zarr.storage import LocalStore


class CountingFile(io.FileIO):
    """A file object that counts the bytes HDF5 reads through it."""

    bytes_read = 0

    def readinto(self, buffer):  # type: ignore[override]
        n = super().readinto(buffer)
        CountingFile.bytes_read += n or 0
        return n

    def read(self, size=-1):  # type: ignore[override]
        data = super().read(size)
        CountingFile.bytes_read += len(data)
        return data


class CountingStore(LocalStore):
    """A zarr LocalStore that records every key and byte count fetched."""

    fetched: list[tuple[str, int]] = []

    async def get(self, key, prototype, byte_range=None):  # type: ignore[override]
        buf = await super().get(key, prototype, byte_range)
        CountingStore.fetched.append((key, 0 if buf is None else len(buf)))
        return buf
