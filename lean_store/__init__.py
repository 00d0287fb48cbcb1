"""lean_store: bit-exact, checked checkpoints of ML model state in HDF5 and Zarr."""

from . import formats
from .encoded import Encoded
from .errors import CheckpointError, FormatError, IntegrityError, LayoutError, UnsafeFileError
from .formats import ScalarFormat
from .layout import Difference, Entry, Layout

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "Difference",
    "Encoded",
    "Entry",
    "FormatError",
    "IntegrityError",
    "Layout",
    "LayoutError",
    "ScalarFormat",
    "UnsafeFileError",
    "formats",
]
