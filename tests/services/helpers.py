"""What the executor's tests share: a lease that answers every run with its own stdin."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.contract.messages import Result, Run, RunStatus


@dataclass
class EchoLease:
    """A worker held for one call: notes "exchange" in `events` and echoes the body."""

    events: list[str]
    kernels_version: str = ""
    wait_s: float = 0.0

    async def exchange(self, run: Run, body: bytes, on_chunk: Any = None) -> tuple[Result, bytes]:
        self.events.append("exchange")
        return Result(status=RunStatus.OK, stdout_len=len(body)), body
