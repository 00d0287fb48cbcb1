"""The CRC-32C of large write units is computed on worker threads started once per process,
not once per save (a thread start costs milliseconds on a busy machine)."""

from __future__ import annotations

import threading

import numpy as np

import lean_store as ls
from lean_store import writing


def test_saves_share_the_crc_workers(tmp_path, monkeypatch):
    seen: list[threading.Thread] = []
    real = writing.crc32c_of

    def recorded(bits, *args):
        seen.append(threading.current_thread())
        return real(bits, *args)

    monkeypatch.setattr(writing, "crc32c_of", recorded)
    real_submitter = writing._submitter

    def submitter(pool):  # units written behind: the file and its CRC on a worker
        submit = real_submitter(pool)

        def on_worker(fn, *args):
            def run():
                seen.append(threading.current_thread())
                return fn(*args)
            return submit(run)
        return on_worker

    monkeypatch.setattr(writing, "_submitter", submitter)
    big = np.arange(1 << 19, dtype=np.float32)  # 2 MiB units: CRC on a worker
    for i, suffix in enumerate([".h5", ".zarr", ".h5", ".zarr"]):
        ls.save({"w": big}, tmp_path / f"m{i}{suffix}", chunk_bytes=2 << 20)
    workers = {t for t in seen if t is not threading.main_thread()}
    assert seen and len(workers) <= 2 and all(t.is_alive() for t in workers)
    assert all(t.name.startswith("lean_store-crc") for t in workers)
    for i, suffix in enumerate([".h5", ".zarr", ".h5", ".zarr"]):
        np.testing.assert_array_equal(ls.load_state(tmp_path / f"m{i}{suffix}")["w"], big)


def test_a_forked_child_starts_its_own_workers():
    pool = writing._crc_pool()
    writing._forget_crc_pool()  # what the child runs after a fork
    try:
        fresh = writing._crc_pool()
        assert fresh is not pool
        assert fresh.submit(writing.crc32c_of, np.ones(4, np.uint8)).result() == \
            writing.crc32c_of(np.ones(4, np.uint8))
    finally:
        fresh.shutdown()
        writing._forget_crc_pool()
    pool.shutdown()
