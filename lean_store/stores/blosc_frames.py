"""Blosc 1 frames, checked before numcodecs decompresses them (both backends' ``"weights"``).

A frame (what ``numcodecs.blosc.compress`` returns, what Zarr's ``blosc`` codec and HDF5's
Blosc filter 32001 store per chunk) starts with a 16-byte header: format version (2 for c-blosc
1.x), codec version, flags, type size, then the decompressed size, the block size and the
frame's own size as little-endian uint32. A frame is at most its input plus the header (an
incompressible input is stored as it is).
"""

from __future__ import annotations

import numpy as np
from numcodecs import blosc

HEADER = 16
MAX_OVERHEAD = 16
FORMAT = 2


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


__all__ = ["HEADER", "MAX_OVERHEAD", "decode_frame", "frame_size_limit"]
