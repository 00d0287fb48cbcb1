"""Looking into checkpoints: verify, statistics, diffs, streamed reads, dask/xarray views."""
