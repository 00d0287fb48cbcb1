"""HDF5 (h5py): writer, reader, types, hostile-file checks, the per-chunk CRC table, the root
manifest, parallel deflate and the sharded (virtual dataset) layout."""
