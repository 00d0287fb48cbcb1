"""The streaming writer: device staging through a bounded pool (with a fake device), CPU
zero-copy, and bounded peak memory when saving a large CPU state (measured in a subprocess)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from torch_optional import needs_torch, torch

import lean_store as ls
from lean_store.chunking import iter_regions, plan_chunks
from lean_store.errors import CheckpointError
from lean_store.formats import of_numpy_dtype
from lean_store.layout import Entry, Layout
from lean_store.sources.base import SourceTensor, TensorSource
from lean_store.stream import BufferPool, CopyEngine, staged
from lean_store.writing import write_source

if torch is not None:  # lean_store.sources.torch_source imports torch
    from lean_store.sources.torch_source import (
        TorchCopyEngine,
        TorchSourceTensor,
        format_of_dtype,
    )


class FakeEngine(CopyEngine):
    """A fake device: copies run later on a worker thread, like a side stream."""

    def __init__(self, delay: float = 0.0) -> None:
        self.pool = ThreadPoolExecutor(1)
        self.delay = delay
        self.log: list[tuple[str, int]] = []
        self.live = 0
        self.peak_live = 0
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.buffer_ids: set[int] = set()
        self.futures: list = []
        self.lock = threading.Lock()

    def allocate(self, nbytes: int) -> np.ndarray:
        with self.lock:
            self.live += 1
            self.live_bytes += nbytes
            self.peak_live = max(self.peak_live, self.live)
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        buf = np.empty(nbytes, np.uint8)
        self.buffer_ids.add(id(buf))
        return buf

    def free(self, buffer: np.ndarray) -> None:
        with self.lock:
            self.live -= 1
            self.live_bytes -= buffer.nbytes

    def nbytes(self, tensor: FakeDeviceTensor, region) -> int:
        return tensor.data[region].nbytes

    def start(self, tensor: FakeDeviceTensor, region, buffer: np.ndarray):
        src = tensor.data[region]
        dst = buffer[: src.nbytes].view(src.dtype).reshape(src.shape)
        self.log.append(("start", tensor.index, region[0].start))

        def copy() -> None:
            time.sleep(self.delay)
            dst[...] = src

        future = self.pool.submit(copy)
        self.futures.append(future)

        def wait() -> np.ndarray:
            future.result()
            return dst

        return wait

    def drain(self) -> None:
        for f in self.futures:
            f.result()


class FakeDeviceTensor(SourceTensor):
    device = "fake:0"

    def __init__(self, data: np.ndarray, engine: FakeEngine, index: int = 0) -> None:
        self.data = data
        self.stage_engine = engine
        self.index = index

    def read(self, region):  # pragma: no cover - staged tensors are never read directly
        raise AssertionError("a device tensor must go through the engine")


def _items(tensors, unit_rows) -> Iterator:
    for t in tensors:
        for region in iter_regions(t.data.shape, (unit_rows,) + t.data.shape[1:]):
            yield (t.index, region[0].start), t, region
        yield (t.index, "end"), None, None


def test_staged_order_reuse_overlap_and_bound() -> None:
    engine = FakeEngine(delay=0.001)
    rng = np.random.default_rng(0)
    tensors = [FakeDeviceTensor(rng.integers(0, 2**31, (64, 256), np.uint32), engine, i)
               for i in range(3)]
    unit = 8 * 256 * 4  # 8 rows
    pools: dict = {}
    got = []
    for key, region, bits in staged(_items(tensors, 8), buffer_bytes=4 * unit, max_buffers=4,
                                    pools=pools):
        if bits is None:
            got.append(key)
            continue
        t = tensors[key[0]]
        # the next unit's copy was started before this one is handed out
        position = engine.log.index(("start", key[0], key[1]))
        if key != (2, 56):
            assert len(engine.log) > position + 1
        engine.drain()  # every copy in flight has landed: none of them may touch this buffer
        np.testing.assert_array_equal(bits, t.data[region])
        got.append(key)
    expected = [k for k, _, _ in _items(tensors, 8)]
    assert got == expected  # C order, tensor by tensor, markers in place
    (pool,) = pools.values()
    assert pool.allocations <= 4 and len(engine.buffer_ids) <= 4  # 24 units, <= 4 buffers
    assert pool.peak_bytes <= 4 * unit and engine.peak_live <= 4
    assert engine.live == 0  # every buffer freed at the end


def test_staged_budget_below_one_unit_still_progresses() -> None:
    engine = FakeEngine()
    t = FakeDeviceTensor(np.arange(4096, dtype=np.uint64).reshape(64, 64), engine)
    pools: dict = {}
    out = [bits.copy() for _, _, bits in staged(_items([t], 16), buffer_bytes=100, pools=pools)
           if bits is not None]
    np.testing.assert_array_equal(np.concatenate(out), t.data)
    assert engine.peak_live == 1  # one unit at a time when the budget is below a unit


def test_staged_mixes_host_and_device_and_frees_on_error() -> None:
    engine = FakeEngine()
    dev = FakeDeviceTensor(np.arange(1024, dtype=np.int32).reshape(32, 32), engine, 0)

    class Host(SourceTensor):
        index = 1
        data = np.arange(512, dtype=np.int16).reshape(16, 32)

        def read(self, region):
            return self.data[region]

    items = list(_items([dev, Host()], 4))
    gen = staged(iter(items), buffer_bytes=1 << 20)
    seen = 0
    with pytest.raises(RuntimeError):
        for _key, _region, _bits in gen:
            seen += 1
            if seen == 3:
                raise RuntimeError("store failed")
    gen.close()
    engine.drain()
    assert engine.live == 0  # the failure left no buffer behind
    out = {k: b.copy() for k, _, b in staged(iter(items), buffer_bytes=1 << 20) if b is not None}
    np.testing.assert_array_equal(out[(1, 4)], Host.data[4:8])
    np.testing.assert_array_equal(out[(0, 28)], dev.data[28:32])


def test_pool_reuses_and_bounds() -> None:
    made: list[int] = []
    pool = BufferPool(lambda n: made.append(n) or bytearray(n), budget_bytes=64, max_buffers=2)
    a = pool.try_acquire(16)
    b = pool.try_acquire(16)
    assert a is not None and b is not None and pool.try_acquire(16) is None  # 2 buffers max
    pool.release(a)
    assert pool.try_acquire(10) is a  # reused, not reallocated
    pool.release(a)
    pool.release(b)
    big = pool.try_acquire(1000)  # larger than the budget: allowed when nothing is in use
    assert big is not None and big.capacity == 1000 and pool.live_buffers == 1
    assert made == [32, 32, 1000]
    with pytest.raises(CheckpointError):
        BufferPool(bytearray, budget_bytes=0)


class _FakeDeviceSource(TensorSource):
    def __init__(self, arrays: dict[str, np.ndarray], engine: FakeEngine) -> None:
        self.arrays = arrays
        self.engine = engine
        self.layout = Layout.from_specs(
            [(n, a.shape, of_numpy_dtype(a.dtype)) for n, a in arrays.items()]
        )

    def tensors(self) -> Iterator[tuple[Entry, SourceTensor]]:
        for i, entry in enumerate(self.layout):
            yield entry, FakeDeviceTensor(self.arrays[entry.name], self.engine, i)


@pytest.mark.parametrize("suffix,budget", [(".h5", 256 << 10), (".zarr", 1 << 20)])
def test_write_source_from_fake_device_is_bounded(tmp_path, suffix, budget) -> None:
    rng = np.random.default_rng(1)
    arrays = {f"w{i}": rng.standard_normal((256, 1024), dtype=np.float32) for i in range(6)}
    arrays["b"] = rng.standard_normal((3,)).astype(np.float16)
    engine = FakeEngine()
    path = tmp_path / f"ck{suffix}"
    # 64 KiB chunks: HDF5 writes chunks, zarr writes 512 KiB shards (8 chunks)
    write_source(_FakeDeviceSource(arrays, engine), path, kind="state", chunk_bytes=64 << 10,
                 buffer_bytes=budget)
    assert engine.peak_live_bytes <= budget and engine.live == 0
    assert len(engine.log) > 12  # many units went through a handful of buffers
    back = ls.load_state(path)
    for name, a in arrays.items():
        np.testing.assert_array_equal(back[name], a)


@needs_torch
@pytest.mark.parametrize("dtype", [] if torch is None else [
    torch.bfloat16, torch.complex64, torch.int64, torch.bool])
def test_torch_copy_engine_bits_match(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(40, 24, 6, generator=g).to(dtype) if dtype != torch.complex64 else (
        torch.randn(40, 24, 6, generator=g, dtype=torch.complex64))
    tensor = base.transpose(0, 1)  # not contiguous: each region is gathered by the copy
    fmt = format_of_dtype(dtype)
    engine = TorchCopyEngine(cuda=False, pin=False)
    staged_t = TorchSourceTensor(tensor, fmt, engine)
    plain = TorchSourceTensor(tensor, fmt)
    assert plain.stage_engine is None and staged_t.stage_engine is engine
    shape = tuple(tensor.shape)
    unit = plan_chunks(shape, fmt.storage_dtype.itemsize, 512)
    items = [(r, staged_t, r) for r in iter_regions(shape, unit)]
    n = 0
    for region, _, bits in staged(items, buffer_bytes=4096, max_buffers=2):
        np.testing.assert_array_equal(bits, plain.read(region))
        n += 1
    assert n == len(items) > 4


@needs_torch
def test_cpu_torch_source_is_zero_copy() -> None:
    t = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    src = TorchSourceTensor(t, format_of_dtype(torch.float32))
    bits = src.read((slice(8, 16), slice(0, 64)))
    assert np.shares_memory(bits, t.numpy())


MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, sys, numpy as np, lean_store as ls

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    rng = np.random.default_rng(0)
    state = {f"w{i}": rng.integers(0, 255, (1 << 20,), dtype=np.uint32) for i in range(64)}
    state["big"] = rng.integers(0, 255, (64, 1 << 20), dtype=np.uint32)  # 256 MiB
    out = {}
    for suffix in (".h5", ".zarr"):
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak RSS
        before = status("VmRSS:")
        ls.save(state, sys.argv[1] + suffix)
        out[suffix] = status("VmHWM:") - before
    print(json.dumps(out))
    """
)


def test_peak_memory_of_a_large_cpu_save_is_bounded(tmp_path) -> None:
    state_bytes = 512 << 20
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path / "big")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    import json

    extra = json.loads(result.stdout.strip().splitlines()[-1])
    for suffix, nbytes in extra.items():
        assert nbytes < 0.25 * state_bytes, f"{suffix}: {nbytes / 2**20:.0f} MiB extra"


@pytest.mark.parametrize("checksum", ["crc32c", "fletcher32+crc32c"])
def test_hdf5_whole_chunk_reads_verify_checksums(tmp_path, checksum) -> None:
    import h5py

    from lean_store.errors import IntegrityError

    a = np.arange(5000, dtype=np.float32).reshape(50, 100)
    path = tmp_path / "ck.h5"
    ls.save({"w": a}, path, chunk_bytes=4096, checksum=checksum)  # chunks of 10 rows
    with ls.open(path) as ck:
        np.testing.assert_array_equal(ck["w"][40:50], a[40:50])  # a whole chunk, fast path
        np.testing.assert_array_equal(ck["w"].read(), a)
    with h5py.File(path, "r") as f:
        offset = f["w"].id.get_chunk_info(2).byte_offset
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 1]))
    with ls.open(path) as ck:
        np.testing.assert_array_equal(ck["w"][0:10], a[0:10])
        with pytest.raises(IntegrityError, match="chunk_crc32c|checksum|fletcher|HDF5"):
            ck["w"][20:30]
