"""tools/bench/compression.py --stages: each codec stage of ``compression="weights"`` measured
alone, per format, on the same weights; nothing timed is asserted, only what it reports."""

from __future__ import annotations

import importlib.util

import pytest
from tool_runner import ROOT

SCRIPT = ROOT / "tools" / "bench" / "compression.py"


def _tool():
    spec = importlib.util.spec_from_file_location("tools_bench_compression", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stages_report_every_plane_of_every_format() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    tool = _tool()
    from numcodecs import blosc

    threads = blosc.get_nthreads()
    stages = tool.bench_codec_stages(tool.mlp(64, 1))
    assert blosc.get_nthreads() == threads  # Blosc's thread count is put back
    widths = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
    assert list(stages) == list(widths)
    for fmt, width in widths.items():
        row = stages[fmt]
        for key in ("blosc compress 1 thread(s)", "blosc compress 2 thread(s)",
                    "blosc decompress 1 thread(s)", "blosc decompress 2 thread(s)",
                    "numpy byte shuffle", "crc32c"):
            assert row[key] > 0, (fmt, key)
        planes = [k for k in row if k.startswith("zstd 1 plane") and "fraction" not in k]
        assert len(planes) == width
        for k in range(width):
            assert 0 < row[f"zstd 1 plane {k} stored fraction"] <= 1.01
        assert 0 < row["stored fraction"] <= 1.01
    # float32's sign/exponent byte (the last plane, little endian) is the one zstd shrinks most
    fractions = [stages["float32"][f"zstd 1 plane {k} stored fraction"] for k in range(4)]
    assert fractions[3] < 0.6 and fractions[3] == min(fractions)
