"""Zarr v3 (zarr-python): writer, reader, direct chunk and shard I/O, the CRC-32C codec,
hostile-store checks, URL stores, incremental steps, the sharded layout, and ``compat``: the one
module that touches zarr-python's internals."""
