"""tools/bench/peers.py --workload sharded (tools/bench/fsdp_peers.py) runs 4 gloo ranks at quick
sizes and reports DCP and both lean_store backends; nothing timed is asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "bench" / "peers.py"


def test_quick_sharded_run_reports_every_method(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.fsdp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--workload", "sharded", "--dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "4 gloo ranks" in out, out
    for method in ("dcp", "lean_store hdf5", "lean_store zarr"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {method} |"))
        save, load, rs, rl, cpu_save, cpu_load = (float(x) for x in
                                                  row.strip("| ").split(" | ")[1:])
        assert save > 0 and load > 0 and rs > 0 and rl > 0
        assert cpu_save > 0 and cpu_load > 0  # the ranks' CPU seconds added up
    assert "| dcp |" in out and "| 1.00 | 1.00 |" in out  # DCP against itself
    assert list(tmp_path.iterdir()) == []  # every file removed
