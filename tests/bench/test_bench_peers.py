"""tools/bench/peers.py runs (quick sizes) and reports every peer; nothing timed is asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "bench" / "peers.py"


def test_quick_run_prints_every_peer(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--workload", "tiny", "--workload", "big",
         "--dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for peer in ("lean_store hdf5", "lean_store zarr", "safetensors", "torch.save",
                 "dcp 1 proc", "numpy"):
        assert f"| tiny | 100 | 0.0 | {peer} |" in out, out
        assert f"  {peer}: " in out  # its fitted per-tensor cost line
    assert "fitted per-tensor cost" in out
    assert list(tmp_path.iterdir()) == []  # every file removed


def test_per_tensor_cost_recovers_a_known_slope() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import peers
    finally:
        sys.path.remove(str(SCRIPT.parent))
    points = [(n, b, 0.01 + 2e-4 * n + 1e-9 * b)
              for n, b in ((10, 1000), (100, 5_000_000), (1000, 20_000), (128, 500_000_000))]
    assert peers.per_tensor_cost(points) == pytest.approx(2e-4)
    assert peers.per_tensor_cost([(10, 1, 1.0), (10, 2, 2.0)]) is None
