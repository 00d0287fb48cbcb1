"""The few collectives a sharded save or load needs, on torch.distributed, with JSON payloads.

Metadata travels as UTF-8 JSON in uint8 tensors (never pickle): ``all_gather_json`` is an
all_gather of lengths, then of padded bytes. ``agree`` is the one place where ranks compare
outcomes: every rank reports success or its error, and if any failed, every rank raises the
same error (type and message of the lowest failing rank).
"""

from __future__ import annotations

import json
from typing import Any

import lean_store.errors as errors

from ..errors import CheckpointError

MAX_MESSAGE = 4000  # characters of one rank's error carried to the others


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
        """Every rank's ``value``, in rank order."""
        torch, dist = self._torch, self._dist
        data = json.dumps(value, separators=(",", ":")).encode("utf-8")
        size = torch.tensor([len(data)], dtype=torch.int64, device=self._device)
        sizes = [torch.zeros_like(size) for _ in range(self.size)]
        dist.all_gather(sizes, size, group=self.group)
        lengths = [int(s.item()) for s in sizes]
        longest = max(lengths)
        buf = torch.zeros(longest, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buf = buf.to(self._device)
        bufs = [torch.zeros(longest, dtype=torch.uint8, device=self._device) for _ in lengths]
        dist.all_gather(bufs, buf, group=self.group)
        return [
            json.loads(bytes(b[:n].cpu().numpy().tobytes()).decode("utf-8"))
            for b, n in zip(bufs, lengths)
        ]

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
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, CheckpointError):
        return cls
    return ShardedError


__all__ = ["Collective", "ShardedError"]
