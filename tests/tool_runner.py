"""Run a script of tools/ as its users do: a child interpreter, this checkout first on
PYTHONPATH. Tests never import tools/ (no sys.path edits); they run the tool and read its
output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The repository root."""


def tool_env() -> dict[str, str]:
    """os.environ with the repository root first on PYTHONPATH (this checkout's lean_store)."""
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def tool_command(script: str, *args: str | os.PathLike) -> list[str]:
    """The command line of ``python tools/<script> ARGS``."""
    return [sys.executable, str(ROOT / "tools" / script), *map(str, args)]


def run_tool(script: str, *args: str | os.PathLike, timeout: float = 900
             ) -> subprocess.CompletedProcess[str]:
    """``python tools/<script> ARGS`` to completion, output captured as text."""
    return subprocess.run(tool_command(script, *args), env=tool_env(), capture_output=True,
                          text=True, timeout=timeout)
