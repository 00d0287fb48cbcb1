"""lean_store: bit-exact, checked checkpoints of ML model state in HDF5 and Zarr.

>>> import lean_store as ls
>>> ls.save(model, "run.h5")            # or "run.zarr"
>>> ls.load(model, "run.h5")            # validated first; the model is unchanged on error
>>> state = ls.load_state("run.h5")     # a new dict of arrays; nothing mutated
>>> with ls.open("run.h5") as ck:       # partial reads touch only the chunks they need
...     ck["layer.weight"][10:20]
"""

from . import distributed, formats, training
from ._version import __version__ as __version__
from .api import load, save, save_async
from .async_save import SaveHandle
from .checkpoint import Checkpoint, LoadResult, TensorHandle, load_state, open
from .encoded import Encoded
from .errors import (
    CheckpointBusyError,
    CheckpointError,
    CheckpointReplacedError,
    ForeignPathError,
    FormatError,
    IntegrityError,
    LayoutError,
    SaveIOError,
    TensorNotFoundError,
    UnsafeFileError,
    UnsupportedValueError,
)
from .formats import ScalarFormat
from .inspection.verify import Problem, VerifyReport, verify
from .layout import Difference, Entry, Layout
from .options import SaveOptions

# the training verbs live in lean_store.training; these are their root aliases
from .training import (
    Checkpointer,
    TrainingInfo,
    load_optimizer,
    load_training,
    save_optimizer,
    save_training,
    training_info,
)

__all__ = [
    "Checkpoint",
    "CheckpointBusyError",
    "Checkpointer",
    "CheckpointError",
    "CheckpointReplacedError",
    "Difference",
    "Encoded",
    "Entry",
    "ForeignPathError",
    "FormatError",
    "IntegrityError",
    "Layout",
    "LayoutError",
    "LoadResult",
    "SaveHandle",
    "SaveIOError",
    "TensorNotFoundError",
    "SaveOptions",
    "ScalarFormat",
    "TensorHandle",
    "TrainingInfo",
    "UnsafeFileError",
    "UnsupportedValueError",
    "distributed",
    "formats",
    "training",
    "load",
    "load_optimizer",
    "load_state",
    "load_training",
    "training_info",
    "open",
    "save",
    "save_async",
    "save_optimizer",
    "save_training",
    "verify",
    "Problem",
    "VerifyReport",
]
