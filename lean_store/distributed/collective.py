"""The few collectives a sharded save or load needs, on torch.distributed, with JSON payloads.

Metadata travels as UTF-8 JSON in uint8 tensors (never pickle): ``all_gather_json`` is one
all_gather of a fixed-size buffer holding the length and, when it fits, the JSON; a longer
payload takes a second, of padded bytes. ``agree`` is the one place where ranks compare
outcomes: every rank reports success or its error, and if any failed, every rank raises the
same error (type and message of the lowest failing rank). ``stage`` wraps one step of a sharded
operation around it: a rank tries the step, its error is recorded, all ranks agree.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import CheckpointError

MAX_MESSAGE = 4000  # characters of one rank's error carried to the others
INLINE_BYTES = 64 << 10
"""JSON payloads up to this size travel in one all-gather (an agreement, a description of a
few hundred tensors); longer ones take a second, of the longest payload."""


class ShardedError(CheckpointError):
    """A sharded save or load failed on at least one rank; every rank raises this."""


class Collective:
    """A process group seen as ``rank``/``size`` plus JSON all-gather and agreement."""

    def __init__(self, group: Any = None) -> None:
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise CheckpointError(
                "a sharded save/load needs torch.distributed: call "
                "torch.distributed.init_process_group first"
            )
        self._dist = dist
        self._torch = torch
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        backend = str(dist.get_backend(group))
        self._device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else (
            torch.device("cpu")
        )

    def all_gather_json(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order: one all-gather of a fixed-size buffer (the
        length, then up to :data:`INLINE_BYTES` of JSON), and a second one of the longest
        payload only when some rank's did not fit."""
        data = json.dumps(value, separators=(",", ":")).encode("utf-8")
        first = bytearray(8 + INLINE_BYTES)
        first[:8] = len(data).to_bytes(8, "little")
        if len(data) <= INLINE_BYTES:
            first[8 : 8 + len(data)] = data
        got = self._gather_bytes(first)
        lengths = [int.from_bytes(b[:8], "little") for b in got]
        if max(lengths) <= INLINE_BYTES:
            return [json.loads(b[8 : 8 + n].decode("utf-8")) for b, n in zip(got, lengths)]
        longest = bytearray(max(lengths))
        longest[: len(data)] = data
        got = self._gather_bytes(longest)
        return [json.loads(b[:n].decode("utf-8")) for b, n in zip(got, lengths)]

    def _gather_bytes(self, data: bytearray) -> list[bytes]:
        """Every rank's ``data`` (the same length on every rank), in rank order."""
        torch = self._torch
        buf = torch.frombuffer(data, dtype=torch.uint8).to(self._device)
        bufs = [torch.empty(len(data), dtype=torch.uint8, device=self._device)
                for _ in range(self.size)]
        self._dist.all_gather(bufs, buf, group=self.group)
        return [b.cpu().numpy().tobytes() for b in bufs]

    def agree(self, error: BaseException | None, payload: Any = None) -> list[Any]:
        """Compare outcomes. Returns every rank's ``payload`` when all succeeded; otherwise
        raises, on every rank, the same error built from the lowest failing rank's report."""
        report = {"ok": error is None, "payload": payload}
        if error is not None:
            report.update(type=type(error).__name__, message=_message(error))
        reports = self.all_gather_json(report)
        failed = [(r, rep) for r, rep in enumerate(reports) if not rep["ok"]]
        if not failed:
            return [rep["payload"] for rep in reports]
        rank, first = failed[0]
        others = f" (and {len(failed) - 1} more ranks failed)" if len(failed) > 1 else ""
        text = f"rank {rank} of {self.size}: {first['message']}{others}"
        cls = _error_class(first["type"])
        exc = cls(text)
        raise exc from error


def _message(error: BaseException) -> str:
    text = str(error) if isinstance(error, CheckpointError) else (
        f"{type(error).__name__}: {error}"
    )
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + " ..."


def _error_class(name: str) -> type[CheckpointError]:
    """The CheckpointError subclass called ``name`` (a failing rank's error type), else
    ShardedError."""
    pending: list[type[CheckpointError]] = [CheckpointError]
    while pending:
        cls = pending.pop()
        if cls.__name__ == name:
            return cls
        pending.extend(cls.__subclasses__())
    return ShardedError


def agree(comm: Collective, error: BaseException | None, payload: Any = None) -> list[Any]:
    """``comm.agree``, turning a broken collective (a dead peer, a timeout) into a
    CheckpointError so every surviving rank reports the failure the same way."""
    try:
        return comm.agree(error, payload)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch.distributed raises RuntimeError and others
        raise ShardedError(
            f"rank {comm.rank}: the process group failed during a sharded checkpoint operation "
            f"({type(exc).__name__}: {exc}); nothing was committed"
        ) from exc


class Stage:
    """One step of a sharded operation on this rank: what it shares with the others."""

    def __init__(self) -> None:
        self._payload: Any = None
        self.shared: list[Any] = []
        """Every rank's shared payload, in rank order, once the stage has ended."""

    def share(self, payload: Any) -> None:
        """Hand ``payload`` (JSON) to every rank when the stage ends."""
        self._payload = payload


@contextmanager
def stage(comm: Collective) -> Iterator[Stage]:
    """Run a step on every rank, then agree: an ``Exception`` raised in the block is recorded
    and, like any other rank's failure, raised on every rank as the same error; on success
    ``st.shared`` holds every rank's ``st.share(...)`` payload.

    >>> with stage(comm) as st:
    ...     st.share(describe(pieces))
    >>> descriptions = st.shared
    """
    st = Stage()
    error: BaseException | None = None
    try:
        yield st
    except Exception as exc:  # noqa: BLE001 - reported to every rank by agree
        error = exc
    st.shared = agree(comm, error, None if error is not None else st._payload)


def on_rank0(comm: Collective, work: Any) -> Any:
    """``work()`` on rank 0 only; every rank gets its (JSON) result or raises its error."""
    with stage(comm) as st:
        if comm.rank == 0:
            st.share(work())
    return st.shared[0]


__all__ = ["Collective", "ShardedError", "Stage", "agree", "on_rank0", "stage"]
