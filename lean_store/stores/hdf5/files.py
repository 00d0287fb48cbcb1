"""h5py files of lean_store, opened through HDF5's POSIX driver whatever the environment says.

libhdf5 takes its default file driver from ``HDF5_DRIVER``: with ``split``, ``multi`` or
``family`` there, a file h5py opens by path is several files on disk (``NAME.meta`` and
``NAME.raw``, ...), so a save left those temporaries behind and failed with a misleading
"no such file", and a load failed to find the checkpoint's one file. A checkpoint is one file,
so lean_store names the driver (``sec2``, HDF5's default, the one the header path's ``pread``
reads through); sources that are not paths (file objects) keep h5py's choice. Whether a file
is HDF5 at all is read from its signature (:func:`is_hdf5`), not asked of libhdf5, which would
open it with that driver too.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import h5py

DRIVER = "sec2"
SIGNATURE = b"\x89HDF\r\n\x1a\n"
"""HDF5's format signature, the first bytes of the superblock."""


def open_file(source: Any, mode: str, **kwargs: Any) -> h5py.File:
    """``h5py.File(source, mode, **kwargs)``, with ``driver="sec2"`` when ``source`` is a path."""
    if isinstance(source, (str, bytes, os.PathLike)):
        kwargs["driver"] = DRIVER
    return h5py.File(source, mode, **kwargs)


def is_hdf5(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file with HDF5's signature where a superblock may start
    (offset 0, 512, 1024, 2048, ...: the places libhdf5 looks). False for anything else,
    including what cannot be read; a FIFO or device is never opened for reading."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        offset = 0
        while offset + len(SIGNATURE) <= st.st_size:
            if os.pread(fd, len(SIGNATURE), offset) == SIGNATURE:
                return True
            offset = 512 if offset == 0 else offset * 2
        return False
    except OSError:
        return False
    finally:
        os.close(fd)


__all__ = ["DRIVER", "SIGNATURE", "is_hdf5", "open_file"]
