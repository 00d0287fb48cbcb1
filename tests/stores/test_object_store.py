"""Zarr checkpoints on S3 through fsspec (s3fs), against a moto S3 server on loopback.

The server runs in a thread of the test process on 127.0.0.1 and a free port, records every
request it serves (method and path), stops when the module's tests end, and shuts itself down
after SERVER_LIFETIME seconds at most. Endpoint and credentials reach s3fs through the standard
AWS environment variables or explicit ``storage_options``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest
from torch_optional import needs_torch

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
SERVER_LIFETIME = 900  # seconds; the fixture stops it far sooner
CHILD_TIMEOUT = 120


class RequestLog:
    """WSGI middleware: remembers (method, path) of every request, then serves it."""

    def __init__(self, app) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []

    def __call__(self, environ, start_response):
        with self.lock:
            self.requests.append((environ["REQUEST_METHOD"], unquote(environ["PATH_INFO"])))
        return self.app(environ, start_response)

    def take(self) -> list[tuple[str, str]]:
        with self.lock:
            out, self.requests = self.requests, []
        return out


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with bucket ``bkt``; yields (endpoint, request log)."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    log = RequestLog(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, log, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    deadline = threading.Timer(SERVER_LIFETIME, server.shutdown)
    deadline.daemon = True
    deadline.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1"
                     ).create_bucket(Bucket="bkt")
        log.take()
        yield endpoint, log
    finally:
        deadline.cancel()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def options(endpoint: str) -> dict:
    return {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"}}


def aws_env(endpoint: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def env(s3, monkeypatch):
    endpoint, log = s3
    for key, value in aws_env(endpoint).items():
        monkeypatch.setenv(key, value)
    import fsspec

    fsspec.filesystem("s3").clear_instance_cache()  # s3fs caches filesystems per options
    return log


def state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "big": rng.standard_normal(300_000).astype(np.float32),  # sharded: 8 chunks per shard
        "w": rng.standard_normal((64, 32)).astype(np.float32),
        "b": np.arange(7, dtype=np.int64),
    }


def same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert np.asarray(a[k]).dtype == b[k].dtype and np.asarray(a[k]).tobytes() == b[k].tobytes()


def test_save_load_verify_with_the_aws_environment(env) -> None:
    import lean_store as ls

    url = "s3://bkt/env/step-1.zarr"
    layout = ls.save(state(), url, chunk_bytes=16384)
    assert layout.names() == ["big", "w", "b"]
    same(ls.load_state(url), state())
    target = {k: np.zeros_like(v) for k, v in state().items()}
    ls.load(target, url)
    same(target, state())
    assert ls.verify(url).ok
    with ls.open(url) as ck:
        assert ck.backend == "zarr" and ck.root_attrs["complete"] is True


def test_explicit_storage_options_without_environment(s3, monkeypatch) -> None:
    import lean_store as ls

    endpoint, _log = s3
    for key in aws_env(endpoint):
        monkeypatch.delenv(key, raising=False)
    url = "s3://bkt/explicit/step-1.zarr"
    ls.save(state(), url, storage_options=options(endpoint))
    with ls.open(url, storage_options=options(endpoint)) as ck:
        assert ck["w"][3:5].tobytes() == state()["w"][3:5].tobytes()
    same(ls.load_state(url, storage_options=options(endpoint)), state())
    with pytest.raises(ls.CheckpointError, match="URLs"):
        ls.save(state(), "/tmp/x.zarr", storage_options=options(endpoint))


def test_partial_reads_touch_only_the_needed_objects(env) -> None:
    import lean_store as ls

    url = "s3://bkt/partial/step-1.zarr"
    ls.save(state(), url, chunk_bytes=16384)
    env.take()
    with ls.open(url) as ck:
        opened = env.take()
        got = ck["big"][100_000:100_010]
        read = env.take()
    assert got.tobytes() == state()["big"][100_000:100_010].tobytes()
    # opening reads metadata documents only: the root, then each array's own zarr.json
    assert {path for _, path in opened} <= {
        "/bkt/partial/step-1.zarr/zarr.json",
        *(f"/bkt/partial/step-1.zarr/{n}/zarr.json" for n in state()),
    }
    assert all(method in ("GET", "HEAD") for method, _ in opened)
    # the slice: requests for one shard of "big" only (existence check, index, inner chunk),
    # then the root zarr.json (HEAD and GET): its save_id says the store was not replaced meanwhile
    root = "/bkt/partial/step-1.zarr/zarr.json"
    objects = {path for _, path in read if path != root}
    shard = 100_000 // (4096 * 8)  # 4096-value chunks, 8 per shard
    assert objects == {f"/bkt/partial/step-1.zarr/big/c.{shard}"}
    assert [m for m, p in read if p == root] in (["GET"], ["HEAD", "GET"])
    assert len(read) <= 6
    data = [p for _, p in opened + read if "/c." in p]  # chunk and shard objects
    assert data == [f"/bkt/partial/step-1.zarr/big/c.{shard}"] * len(data)


def test_an_interrupted_upload_is_never_read_as_a_checkpoint(env, s3, tmp_path) -> None:
    """A writer killed after some chunks: the prefix holds data but the root zarr.json (the
    commit marker, written last) does not say complete; every reader refuses it."""
    import lean_store as ls

    endpoint, _log = s3
    url = "s3://bkt/crash/step-1.zarr"
    child = subprocess.run(
        [sys.executable, str(HERE), "crash", url], env=child_env(endpoint),
        capture_output=True, text=True, timeout=CHILD_TIMEOUT,
    )
    assert child.returncode == 17, child.stdout + child.stderr
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    written = fs.find("bkt/crash/step-1.zarr")
    assert "bkt/crash/step-1.zarr/zarr.json" in written
    assert any("/big/c." in key for key in written)  # data was uploaded
    root = json.loads(fs.cat("bkt/crash/step-1.zarr/zarr.json"))
    assert "complete" not in root["attributes"]
    refused = "not a lean_store checkpoint|incomplete checkpoint"  # no header or no marker yet
    with pytest.raises(ls.IntegrityError, match=refused):
        ls.open(url)
    with pytest.raises(ls.IntegrityError, match=refused):
        ls.load_state(url)
    assert not ls.verify(url).ok
    with pytest.raises(ls.CheckpointError, match="never overwrites"):
        ls.save(state(), url)  # a new prefix per step; the debris is left for inspection


def test_a_failed_save_removes_its_prefix_and_overwriting_is_refused(env) -> None:
    import fsspec

    import lean_store as ls

    url = "s3://bkt/fail/step-1.zarr"

    bad = {"w": state()["w"], "x": object()}
    with pytest.raises(ls.CheckpointError):
        ls.save(bad, url)
    ok = state()
    ok["big"] = ok["big"].reshape(-1, 3)  # 100000 x 3: several shards
    from lean_store.stores.zarr import store as zarr_store

    original = zarr_store.ZarrTensorWriter.write
    calls = {"n": 0}

    def failing(self, region, bits, crc=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("connection reset")
        return original(self, region, bits, crc)

    zarr_store.ZarrTensorWriter.write = failing
    try:
        with pytest.raises(OSError, match="connection reset"):
            ls.save(ok, url, chunk_bytes=16384)
    finally:
        zarr_store.ZarrTensorWriter.write = original
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    assert not fs.exists("bkt/fail/step-1.zarr")  # removed: a retry can use the same prefix
    ls.save(ok, url, chunk_bytes=16384)
    with pytest.raises(ls.CheckpointError, match="never overwrites"):
        ls.save(ok, url)
    same(ls.load_state(url), ok)


@needs_torch
def test_two_ranks_save_shards_into_one_bucket(env, s3, tmp_path) -> None:
    import lean_store as ls

    endpoint, _log = s3
    url = "s3://bkt/sharded/step-1.zarr"
    port = _free_port()
    procs = [
        subprocess.Popen([sys.executable, str(HERE), "rank", url, str(rank), "2", str(port)],
                         env=child_env(endpoint), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for rank in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=CHILD_TIMEOUT)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    got = ls.load_state(url)
    same(got, sharded_state_whole())
    with ls.open(url) as ck:
        shards = json.loads(ck.root_attrs["sharded"])
        assert shards["world_size"] == 2
    assert ls.verify(url).ok


@needs_torch
def test_lightning_checkpoints_on_s3(env) -> None:
    import torch

    from lean_store.interop.lightning import CheckpointIO

    io = CheckpointIO(backend="zarr")
    url = "s3://bkt/lightning/epoch=0-step=4.ckpt"
    checkpoint = {"epoch": 0, "state_dict": {"w": torch.arange(4.0)}}
    io.save_checkpoint(checkpoint, url)
    got = io.load_checkpoint(url)
    assert got["epoch"] == 0 and torch.equal(got["state_dict"]["w"], torch.arange(4.0))
    io.remove_checkpoint(url)
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    assert not fs.exists("bkt/lightning/epoch=0-step=4.ckpt")


# ------------------------------------------------------------------------ child processes


def child_env(endpoint: str) -> dict[str, str]:
    path = os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, **aws_env(endpoint), "PYTHONPATH": path, "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sharded_state_whole() -> dict[str, np.ndarray]:
    return {"w": np.arange(64 * 48, dtype=np.float32).reshape(64, 48),
            "b": np.arange(10, dtype=np.int32)}


def _crash(url: str) -> None:
    """Save, and die (no cleanup, as a killed process) after the third write unit."""
    import lean_store as ls
    from lean_store.stores.zarr import store as zarr_store

    original = zarr_store.ZarrTensorWriter.write
    calls = {"n": 0}

    def dying(self, region, bits, crc=None):
        calls["n"] += 1
        if calls["n"] == 3:
            os._exit(17)
        return original(self, region, bits, crc)

    zarr_store.ZarrTensorWriter.write = dying
    ls.save(state(), url, chunk_bytes=16384)


def _rank(url: str, rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    import lean_store as ls
    from lean_store.distributed import LocalShard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        whole = sharded_state_whole()
        rows = 64 // world
        local = {
            "w": LocalShard(whole["w"][rank * rows:(rank + 1) * rows], (64, 48), (rank * rows, 0)),
            "b": whole["b"],  # replicated: written once, by rank 0
        }
        ls.save(local, url, process_group=dist.group.WORLD)
    except BaseException:
        dist.destroy_process_group()
        raise
    from gloo_world import leave_world

    leave_world()


if __name__ == "__main__":
    if sys.argv[1] == "crash":
        _crash(sys.argv[2])
    else:
        _rank(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))


def test_zarr_json_tensor_names_on_s3(env) -> None:
    """A tensor named zarr.json is the array %7Aarr.json on S3 too (FORMAT.md 2.1). Before
    that rule the save succeeded there (a key and a prefix of one name coexist), but zarr's
    listing skips an array named zarr.json: the checkpoint was committed and never opened."""
    import fsspec

    import lean_store as ls

    saved = {"zarr.json": np.arange(5, dtype=np.float32), "ZARR.JSON.b": np.arange(3)}
    url = "s3://bkt/names/step-1.zarr"
    ls.save(saved, url)
    fs = fsspec.filesystem("s3")
    assert sorted(fs.ls("bkt/names/step-1.zarr", detail=False)) == [
        "bkt/names/step-1.zarr/%7Aarr.json", "bkt/names/step-1.zarr/ZARR.JSON.b",
        "bkt/names/step-1.zarr/zarr.json"]
    same(ls.load_state(url), saved)
    with ls.open(url) as ck:
        assert ck.stored("zarr.json").node == "%7Aarr.json"
    assert ls.verify(url).ok
