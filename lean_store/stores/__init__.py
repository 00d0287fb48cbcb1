"""Stores: the interface every backend implements (``base``), the backends (``hdf5``, ``zarr``),
the registry that picks one for a path (``registry``), what a save may replace (``target``), and
the one commit every writer publishes through (``commit``)."""
