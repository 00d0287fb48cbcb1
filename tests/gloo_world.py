"""Multi-process gloo worlds for the sharded tests: a test file runs itself as ``world`` ranks
of one scenario (``python FILE SCENARIO RANK WORLD PORT OUT``); each rank writes its record
as JSON, which :func:`run_world` returns."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(script: Path, scenario: str, world: int, out: Path, *, timeout: float = 120,
              expect_rc: dict | None = None) -> list[Any]:
    """Run ``script`` as ``world`` ranks of ``scenario``; their records (None for a rank that
    wrote none). Each rank's exit status must be ``expect_rc.get(rank, 0)``."""
    port = free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "MASTER_ADDR": "127.0.0.1",  # the repository root and tests/ (torch_optional):
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS),
                                          os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen([sys.executable, str(script), scenario, str(r), str(world), str(port),
                          str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    expect_rc = expect_rc or {}
    for r, p in enumerate(procs):
        want = expect_rc.get(r, 0)
        assert p.returncode == want, f"rank {r} exited {p.returncode}:\n{logs[r][-4000:]}"
    return [
        json.loads((out / f"{scenario}-{r}.json").read_text())
        if (out / f"{scenario}-{r}.json").exists() else None
        for r in range(world)
    ]


def torch_world(tmp_path_factory: Any, script: Path, scenario: str, world: int, *,
                timeout: float = 120) -> list[Any]:
    """:func:`run_world` for a module-scoped fixture: skipped without torch, in a fresh
    directory named after the scenario."""
    from torch_optional import require_torch

    require_torch()
    out = tmp_path_factory.mktemp(f"world_{scenario}")
    return run_world(script, scenario, world, out, timeout=timeout)


def worker(scenarios: dict[str, Callable[[int, int, Path], Any]], scenario: str, rank: int,
           world: int, port: int, out: Path, *, timeout_s: float = 60) -> None:
    """One rank: join the gloo world, run the scenario, write its record."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        rec = scenarios[scenario](rank, world, out)
        (out / f"{scenario}-{rank}.json").write_text(json.dumps(rec))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_world()


def leave_world() -> NoReturn:
    """Destroy the process group and exit at once, without interpreter finalization.

    After ``destroy_process_group`` torch's gloo worker threads can outlive it (torch's own
    caches keep the group) and may still be dropping the last collective's work object, whose
    tensors need the GIL. If that lands while the interpreter finalizes, the thread is ended
    inside a C++ frame and the rank aborts: "terminate called without an active exception"
    (1 run in ~25 of a 4-rank DTensor world here; the mechanism is the one described in
    pytorch/pytorch#179291, closed unmerged). The rank's record is on disk by now, so it
    leaves with ``os._exit(0)``: the race is torch's, and a test must not depend on it."""
    import torch.distributed as dist

    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(scenarios: dict[str, Callable[[int, int, Path], Any]], *,
         timeout_s: float = 60) -> None:
    """The ``__main__`` of a test file run as a rank: ``SCENARIO RANK WORLD PORT OUT``."""
    scenario, rank, world, port, out = sys.argv[1:6]
    worker(scenarios, scenario, int(rank), int(world), int(port), Path(out), timeout_s=timeout_s)
