"""tools/bench/peers.py runs (quick sizes) and reports every peer; nothing timed is asserted."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tool_runner import ROOT, run_tool

SCRIPT = ROOT / "tools" / "bench" / "peers.py"


def test_quick_run_prints_every_peer(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    done = run_tool("bench/peers.py", "--quick", "--workload", "tiny", "--workload", "big",
                    "--first-load", "--dir", tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for peer in ("lean_store hdf5", "lean_store zarr", "safetensors", "torch.save",
                 "dcp 1 proc", "numpy"):
        assert f"| tiny | 100 | 0.0 | {peer} |" in out, out
        assert f"  {peer}: " in out  # its fitted per-tensor cost line
    assert "fitted per-tensor cost" in out
    assert "first load in a new process" in out
    first = out.split("first load in a new process", 1)[1]
    for workload in ("tiny", "big"):  # a time for every peer (none missing, none failed)
        row = next(line for line in first.splitlines() if line.startswith(f"| {workload} |"))
        assert row.count("|") == 8 and " - " not in row, row
    assert "allocator: MALLOC_MMAP_THRESHOLD_=33554432" in out  # re-executed with it
    assert list(tmp_path.iterdir()) == []  # every file removed


def test_overwrite_run_saves_over_each_peers_previous_checkpoint(tmp_path: Path) -> None:
    """--overwrite: every peer saves over its previous round's checkpoint (one warm-up round
    makes it), and every file is removed after."""
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    done = run_tool("bench/peers.py", "--quick", "--overwrite", "--repeat", "2", "--workload",
                    "tiny", "--peer", "lean_store hdf5", "--peer", "lean_store zarr",
                    "--peer", "safetensors", "--dir", tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr
    for peer in ("lean_store hdf5", "lean_store zarr", "safetensors"):
        assert f"| tiny | 100 | 0.0 | {peer} |" in done.stdout, done.stdout
    assert list(tmp_path.iterdir()) == []


def test_per_tensor_cost_recovers_a_known_slope() -> None:
    # the script loaded from its file (not from sys.path): its fit, without running it
    spec = importlib.util.spec_from_file_location("tools_bench_peers", SCRIPT)
    assert spec is not None and spec.loader is not None
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    points = [(n, b, 0.01 + 2e-4 * n + 1e-9 * b)
              for n, b in ((10, 1000), (100, 5_000_000), (1000, 20_000), (128, 500_000_000))]
    assert peers.per_tensor_cost(points) == pytest.approx(2e-4)
    assert peers.per_tensor_cost([(10, 1, 1.0), (10, 2, 2.0)]) is None
