"""Stores: the interface every backend implements (``base``), the backends (``hdf5``, ``zarr``),
the registry that picks one for a path (``registry``), and what a save may replace (``target``)."""
