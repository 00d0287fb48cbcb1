"""Crash soak: SIGKILL a writer at random moments during saves and check what survives.

After each kill the checkpoint at the path must load bit-exact as either the previous state or
the new one (never a mix, never silently wrong), a fresh path must hold nothing or the new state,
and any temporary sibling left behind must be rejected (or be a complete copy of the new state).
The temporaries killed overwrites leave stay until the next save to the path commits, which must
have removed them (lean_store.stores.leftovers).

    .venv/bin/python tools/crash_soak.py --kills 1000            # both backends
    .venv/bin/python tools/crash_soak.py --kills 200 --backend zarr

Writers are forked from a pre-imported server process (``--serve``), so a kill costs
milliseconds rather than an interpreter start.
"""

from __future__ import annotations

import argparse
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

SUFFIX = {"hdf5": ".h5", "zarr": ".zarr"}
CHUNK_BYTES = 1024


def make_state(seed: int) -> dict[str, np.ndarray]:
    """A small state with several dtypes and many chunks; different for every seed."""
    rng = np.random.default_rng(seed)
    return {
        "layer.weight": rng.standard_normal((48, 64)).astype(np.float32),
        "layer.bias": rng.standard_normal(64).astype(ml_dtypes.bfloat16),
        "embed": rng.standard_normal((40, 33)).astype(np.float64),
        "half": rng.standard_normal((20, 50)).astype(np.float16),
        "steps": rng.integers(-(2**40), 2**40, size=300, dtype=np.int64),
        "mask": rng.integers(0, 2, size=(17, 19)).astype(bool),
        "phase": (rng.standard_normal(70) + 1j * rng.standard_normal(70)).astype(np.complex64),
    }


def bits(state: dict) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    out = {}
    for name, value in state.items():
        arr = np.ascontiguousarray(np.asarray(value))
        out[name] = (str(arr.dtype), arr.shape, arr.view(np.uint8).tobytes())
    return out


# ------------------------------------------------------------------------------ fork server


def serve() -> None:
    """Read ``SAVE path backend seed`` lines; fork a writer for each, print its pid, then
    ``DONE status`` once it has exited (normally or killed)."""
    import lean_store as ls

    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "QUIT":
            return
        _, path, backend, seed = parts
        state = make_state(int(seed))
        pid = os.fork()
        if pid == 0:  # the writer
            code = 0
            try:
                ls.save(state, path, backend=backend, chunk_bytes=CHUNK_BYTES)
            except BaseException:  # noqa: BLE001 - reported by exit status and on stderr
                import traceback

                traceback.print_exc()
                code = 3
            os._exit(code)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"DONE {status}", flush=True)


class Server:
    """Driver side of the fork server."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
        )
        self._unread = b""  # what came after the last line handed out

    def _line(self, timeout: float = 60.0) -> str:
        """The server's next line. Read from the descriptor with a buffer of our own: a
        buffered reader could take the writer's pid and its ``DONE`` in one read (a fast save
        on a busy machine), and ``select`` would then wait for a line already read."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._unread:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("crash server did not answer")
            data = os.read(fd, 4096)
            if not data:
                raise RuntimeError("crash server exited")
            self._unread += data
        line, self._unread = self._unread.split(b"\n", 1)
        return line.decode().strip()

    def save(self, path: Path, backend: str, seed: int, kill_after: float | None) -> str:
        """Start a save; SIGKILL it after ``kill_after`` seconds. Returns 'killed' or 'done';
        ``self.last_time`` is how long the writer lived."""
        assert self.proc.stdin is not None
        start = time.perf_counter()
        self.proc.stdin.write(f"SAVE {path} {backend} {seed}\n".encode())
        self.proc.stdin.flush()
        pid = int(self._line())
        if kill_after is not None:
            time.sleep(kill_after)
            try:
                os.kill(pid, signal.SIGKILL)  # the server reaps it only after DONE: no pid reuse
            except ProcessLookupError:
                pass
        status = int(self._line().split()[1])
        self.last_time = time.perf_counter() - start
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            return "killed"
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            return "done"
        raise RuntimeError(f"writer failed with status {status}")

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(b"QUIT\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------------------ the checks


@dataclass
class Tally:
    kills: int = 0
    save_times: list[float] = field(default_factory=list)
    outcomes: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    kept: set[Path] = field(default_factory=set)  # temporaries checked and left for a save


def _load_bits(path: Path):
    import lean_store as ls

    return bits(ls.load_state(path))


def _check_leftovers(directory: Path, name: str, new: dict, tally: Tally,
                     previous: dict | None = None, keep: bool = False) -> None:
    """Hidden temporaries a kill left: each is rejected, or is the new state complete, or (a
    kill between the atomic exchange and the removal of what it swapped out) the previous
    checkpoint, whole. ``keep``: the temporaries stay, for the next committed save to the
    path to remove (:func:`_check_cleared`); anything else is removed here."""
    import lean_store as ls

    for leftover in directory.glob(f".{name}.lean_store-*"):
        if leftover in tally.kept:  # checked in the round its save was killed, against that
            continue                # round's states; a later round's kill left it in place
        try:
            got = _load_bits(leftover)
        except ls.CheckpointError as exc:
            tally.outcomes["leftover rejected: " + _reason(exc)] += 1
        else:
            if got == new:
                tally.outcomes["leftover complete and bit-exact"] += 1
            elif previous is not None and got == previous:
                tally.outcomes["leftover: the swapped-out previous checkpoint, whole"] += 1
            else:
                tally.failures.append(f"leftover {leftover} loaded WRONG data")
        if keep and ".lean_store-tmp-" in leftover.name:
            tally.kept.add(leftover)
            continue
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()


def _check_cleared(directory: Path, name: str, before: list[Path], tally: Tally) -> None:
    """A committed save to ``name`` removed the temporaries killed saves left (``before``)."""
    left = [p for p in before if os.path.lexists(p)]
    if left:
        tally.failures.append(f"a committed save left dead saves' temporaries: {left}")
    elif before:
        tally.outcomes["dead saves' temporaries removed by the next committed save"] += 1


def _reason(exc: Exception) -> str:
    text = str(exc)
    for key in ("incomplete", "not a readable", "not a lean_store", "truncated", "missing"):
        if key in text:
            return key
    return f"{type(exc).__name__} ({text.split(': ', 1)[-1][:40]})"  # not the path


def _delay(tally: Tally, rng: random.Random) -> float:
    """Uniform over the typical save duration (median of recent completed saves), so kills
    land anywhere in a save even when the disk speed drifts."""
    recent = sorted(tally.save_times[-9:])
    return rng.uniform(0.1, 1.1) * recent[len(recent) // 2]


def _record(server: Server, outcome: str, tally: Tally) -> None:
    if outcome == "done":
        tally.save_times.append(server.last_time)
    else:
        tally.kills += 1


def run_round(
    server: Server, directory: Path, backend: str, seed: int, tally: Tally,
    rng: random.Random,
) -> None:
    """Two kills: one overwriting an existing checkpoint, one writing a fresh path."""
    import lean_store as ls

    new_state = bits(make_state(seed + 1))
    # 1. overwrite: the previous checkpoint must survive intact until the new one is in place
    path = directory / f"ck{SUFFIX[backend]}"
    if not path.exists():
        server.save(path, backend, seed, None)
    current = _load_bits(path)
    dead = sorted(directory.glob(f".{path.name}.lean_store-tmp-*"))  # of killed saves
    outcome = server.save(path, backend, seed + 1, _delay(tally, rng))
    _record(server, outcome, tally)
    if outcome == "done":
        _check_cleared(directory, path.name, dead, tally)
    try:
        got = _load_bits(path)
    except ls.CheckpointError as exc:
        tally.failures.append(f"{backend} overwrite: previous checkpoint lost ({exc})")
        got = None
    if got is not None:
        if got == new_state:
            tally.outcomes[f"overwrite {outcome}: new state"] += 1
        elif got == current:
            tally.outcomes[f"overwrite {outcome}: previous state"] += 1
            if outcome == "done":
                tally.failures.append(f"{backend}: completed save left the previous state")
        else:
            tally.failures.append(f"{backend} overwrite: SILENTLY WRONG data after a kill")
        report = ls.verify(path)
        if not report.ok:
            tally.failures.append(f"{backend} overwrite: verify failed: {report}")
    _check_leftovers(directory, path.name, new_state, tally, previous=current, keep=True)
    # 2. fresh path: nothing, or the complete new state
    fresh = directory / f"fresh{seed}{SUFFIX[backend]}"
    outcome = server.save(fresh, backend, seed + 1, _delay(tally, rng))
    _record(server, outcome, tally)
    if fresh.exists():
        try:
            got = _load_bits(fresh)
        except ls.CheckpointError as exc:
            tally.failures.append(f"{backend} fresh: a committed path does not load ({exc})")
        else:
            if got == new_state:
                tally.outcomes[f"fresh {outcome}: new state"] += 1
            else:
                tally.failures.append(f"{backend} fresh: SILENTLY WRONG data after a kill")
    else:
        tally.outcomes[f"fresh {outcome}: nothing at the path"] += 1
        if outcome == "done":
            tally.failures.append(f"{backend}: completed save left nothing")
    _check_leftovers(directory, fresh.name, new_state, tally)
    if fresh.exists():
        shutil.rmtree(fresh) if fresh.is_dir() else fresh.unlink()


def measure_save(server: Server, directory: Path, backend: str, tally: Tally) -> None:
    for i in range(3):
        server.save(directory / f"timing{SUFFIX[backend]}", backend, 10_000 + i, None)
        tally.save_times.append(server.last_time)


def soak(backend: str, kills: int, seed: int = 0, directory: Path | None = None) -> Tally:
    """Kill writers until ``kills`` kills happened (saves that finished first don't count)."""
    rng = random.Random(seed)
    tally = Tally()
    own = directory is None
    directory = Path(tempfile.mkdtemp(prefix=f"crash-{backend}-")) if own else directory
    server = Server()
    try:
        measure_save(server, directory, backend, tally)
        round_seed = seed * 1_000_003
        while tally.kills < kills and len(tally.failures) < 20:
            run_round(server, directory, backend, round_seed, tally, rng)
            round_seed += 2
    finally:
        server.close()
        if own:
            shutil.rmtree(directory, ignore_errors=True)
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kills", type=int, default=500, help="kills per backend")
    parser.add_argument("--backend", choices=("hdf5", "zarr", "both"), default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write (default: a temporary directory on the real disk)")
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return 0
    failed = False
    for backend in ("hdf5", "zarr") if args.backend == "both" else (args.backend,):
        start = time.perf_counter()
        directory = None
        if args.dir is not None:
            Path(args.dir).mkdir(parents=True, exist_ok=True)
            directory = Path(tempfile.mkdtemp(prefix=f"crash-{backend}-", dir=args.dir))
        tally = soak(backend, args.kills, args.seed, directory)
        print(f"{backend}: {tally.kills} kills in {time.perf_counter() - start:.1f} s")
        for outcome, n in sorted(tally.outcomes.items()):
            print(f"  {n:6d}  {outcome}")
        for failure in tally.failures:
            print(f"  FAIL  {failure}")
        failed |= bool(tally.failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
