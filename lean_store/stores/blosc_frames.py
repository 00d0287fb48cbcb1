"""Blosc 1 frames, checked before numcodecs decompresses them (both backends' ``"weights"``).

A frame (what ``numcodecs.blosc.compress`` returns, what Zarr's ``blosc`` codec and HDF5's
Blosc filter 32001 store per chunk) starts with a 16-byte header: format version (2 for c-blosc
1.x), codec version, flags, type size, then the decompressed size, the block size and the
frame's own size as little-endian uint32. A frame is at most its input plus the header (an
incompressible input is stored as it is).

Frames are made by :func:`compress`, whatever ``BLOSC_*`` variables the environment holds:
c-blosc's global path, which numcodecs takes on the main thread, lets them replace the codec,
level, shuffle, type size or block size it is given, or fail on a value it does not know
(``BLOSC_SPLITMODE=``), while its one-thread context, taken on other threads, reads none.
"""

from __future__ import annotations

import os
import threading

import numpy as np
from numcodecs import blosc

from ..errors import CheckpointError
from ..shared_threads import SharedThreads

HEADER = 16
MAX_OVERHEAD = 16
FORMAT = 2

CBLOSC_ENVIRONMENT = ("BLOSC_CLEVEL", "BLOSC_SHUFFLE", "BLOSC_TYPESIZE", "BLOSC_COMPRESSOR",
                      "BLOSC_BLOCKSIZE", "BLOSC_NTHREADS", "BLOSC_SPLITMODE", "BLOSC_NOLOCK")
"""The variables c-blosc 1's ``blosc_compress`` (its global path) reads on every call."""

_CODEC_FORMATS = {b"blosclz": 0, b"lz4": 1, b"lz4hc": 1, b"snappy": 2, b"zlib": 3, b"zstd": 4}
"""Compressor name -> the format code a frame's flags carry in their top three bits."""
_SHUFFLE_FLAGS = 0x01 | 0x04  # byte shuffle, bit shuffle
_OWN_CONTEXT = SharedThreads(1, "lean_store-blosc")


def compress(chunk: np.ndarray, cname: bytes, clevel: int, shuffle: int, blocksize: int,
             typesize: int) -> bytes:
    """``numcodecs.blosc.compress`` of ``chunk`` with exactly these parameters (module
    docstring: on the main thread with a ``BLOSC_*`` variable set, the frame is made on a worker
    thread), its header checked for the codec, shuffle and type size asked.
    CheckpointError, naming the variables set, when c-blosc fails or wrote something else."""
    if threading.current_thread() is threading.main_thread() \
            and any(name in os.environ for name in CBLOSC_ENVIRONMENT):
        return _OWN_CONTEXT.get().submit(_compress_checked, chunk, cname, clevel, shuffle,
                                         blocksize, typesize).result()
    return _compress_checked(chunk, cname, clevel, shuffle, blocksize, typesize)


def _compress_checked(chunk: np.ndarray, cname: bytes, clevel: int, shuffle: int,
                      blocksize: int, typesize: int) -> bytes:
    try:
        frame = blosc.compress(chunk, cname, clevel, shuffle, blocksize, typesize=typesize)
    except (RuntimeError, ValueError) as exc:
        raise CheckpointError(f"Blosc could not compress a chunk with {cname.decode()} level "
                              f"{clevel} ({exc}){_environment()}") from exc
    flags = frame[2]
    wanted = (1 if shuffle == blosc.SHUFFLE else 4 if shuffle == blosc.BITSHUFFLE else 0)
    if frame[0] != FORMAT or flags >> 5 != _CODEC_FORMATS.get(cname) \
            or flags & _SHUFFLE_FLAGS != wanted or frame[3] != typesize:
        raise CheckpointError(
            f"Blosc wrote a frame other than asked (format {frame[0]}, flags {flags:#04x}, type "
            f"size {frame[3]}; asked: {cname.decode()}, shuffle {shuffle}, type size "
            f"{typesize}){_environment()}; nothing was saved with it")
    return frame


def _environment() -> str:
    found = [f"{name}={os.environ[name]!r}" for name in CBLOSC_ENVIRONMENT
             if name in os.environ]
    if not found:
        return ""
    return (f"; the environment sets {', '.join(found)}, which c-blosc applies to every "
            "frame made on its global path: unset them (or leave numcodecs.blosc.use_threads "
            "at None) for lean_store's saves")


def frame_size_limit(chunk_nbytes: int) -> int:
    """The most bytes a frame of a ``chunk_nbytes`` chunk takes."""
    return chunk_nbytes + MAX_OVERHEAD


def decode_frame(frame: np.ndarray, chunk_nbytes: int, dst: np.ndarray) -> str | None:
    """Decompress one frame (flat uint8) of a ``chunk_nbytes`` chunk into ``dst`` (flat
    uint8: the whole chunk, or a prefix of it at an array's edge), after checking its header:
    format 2, the decompressed size equal to ``chunk_nbytes``, the frame's size equal to the
    bytes given. Returns what is wrong, or None when ``dst`` holds the chunk's bytes."""
    if frame.size < HEADER:
        return f"is too short for a Blosc frame ({frame.size} bytes)"
    head = frame[:HEADER].tobytes()
    nbytes, cbytes = (int.from_bytes(head[i:i + 4], "little") for i in (4, 12))
    if head[0] != FORMAT or nbytes != chunk_nbytes or cbytes != frame.size:
        return (f"has a bad Blosc header (format {head[0]}, {nbytes} bytes from {cbytes}; "
                f"expected format {FORMAT}, {chunk_nbytes} bytes from {frame.size})")
    target = dst if dst.size == chunk_nbytes else np.empty(chunk_nbytes, np.uint8)
    try:
        blosc.decompress(frame, target)
    except (RuntimeError, ValueError) as exc:
        return f"does not decompress ({exc})"
    if target is not dst:
        dst[...] = target[: dst.size]
    return None


__all__ = ["CBLOSC_ENVIRONMENT", "HEADER", "MAX_OVERHEAD", "compress", "decode_frame",
           "frame_size_limit"]
