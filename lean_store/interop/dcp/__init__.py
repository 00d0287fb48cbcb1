"""torch.distributed.checkpoint (DCP) storage backend: ``dcp.save`` / ``dcp.async_save`` write,
and ``dcp.load`` reads, ordinary lean_store checkpoints.

```python
import torch.distributed.checkpoint as dcp
import lean_store.interop.dcp

dcp.save(state_dict, storage_writer=lean_store.interop.dcp.StorageWriter("step-100.zarr"))
dcp.load(state_dict, storage_reader=lean_store.interop.dcp.StorageReader("step-100.zarr"))
```

This is the only part of lean_store that imports torch.distributed.checkpoint; importing it
needs torch.
"""

from .reader import StorageReader
from .writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter"]
