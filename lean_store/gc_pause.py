"""Python's cyclic garbage collector paused for the length of a load.

A load allocates small containers per tensor (manifest records, parsed metadata documents, read
plans), none of them in reference cycles, so reference counting frees them all; with tens of
thousands of tensors the collections they set off cost ~25 % of a single-process load (20,000
tensors: Zarr 2.1 -> 1.6 s, HDF5 1.0 -> 0.8 s). A sharded load allocates tens of thousands of
small containers (shard records, boxes, read plans, agreement payloads), none of them in
reference cycles, so reference counting frees them all. In a training process, whose heap holds
the model, the optimizer and torch's own objects, those allocations set off full (generation 2)
collections that walk the whole heap: measured ~30 ms of CPU per rank per load of a 208-tensor
FSDP2 state (about 15 % of the load), spent looking for cycles that are not there. The collector
is switched off while the load runs and back on after it, only if it was on before and is still
off, so nested or concurrent pauses and a caller's own ``gc.disable()`` are respected.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic cyclic collection inside the block; the collector's state restored after."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused and not gc.isenabled():
            gc.enable()
