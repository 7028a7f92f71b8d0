"""What a call holds while it runs: a lease on one worker, and the kernel set it may carry."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from app.contract.frames import Payload
from app.contract.messages import Outcome, Refused, Result, Run, WorkerMessage

if TYPE_CHECKING:
    from app.scheduler.fairness import Ticket
    from app.scheduler.scheduler import _Tenant
    from app.worker.handle import WorkerHandle


@dataclass(frozen=True)
class KernelSet:
    """A tenant's kernel sources; `version` is their content hash, the same in every front."""

    version: str
    sources: dict[str, str]

    @classmethod
    def of(cls, sources: dict[str, str]) -> KernelSet:
        if not sources:
            return cls("", {})
        digest = hashlib.sha256()
        for name in sorted(sources):
            digest.update(hashlib.sha256(name.encode()).digest())
            digest.update(hashlib.sha256(sources[name].encode()).digest())
        return cls(digest.hexdigest()[:32], dict(sources))


@dataclass(eq=False)
class Lease:
    """One call's hold on one worker, from `Scheduler.lease` to `Scheduler.release`."""

    id: str
    worker: WorkerHandle
    tenant: _Tenant
    ticket: Ticket
    kernels_version: str  # what the worker holds at the grant
    released: bool = False
    wait_s: float = 0.0  # the leased worker is the call's alone

    async def exchange(self, run: Run, body: bytes, on_chunk: Callable[[Payload], None] | None = None) -> tuple[WorkerMessage, Payload]:
        """In a one-process node the call goes over the worker's pipe."""
        return await self.worker.request(run, body, on_chunk)


class WaitState(Enum):
    QUEUED = 1  # waiting for a slot (its tenant's concurrency, the fair share)
    BINDING = 2  # holds its slot, a task looks for a worker (a bind, an eviction)
    GRANTED = 3  # the lease was handed over: its holder releases it
    FAILED = 4  # refused (queue wait over, no capacity in its time): nothing held
    WITHDRAWN = 5  # its caller went away: whatever it held was given back


@dataclass(eq=False)
class Waiting:
    """A call `Scheduler.queue_lease` queued. While it waits for a slot it costs the scheduler a
    ticket and a timer, no task; `granted` or `failed` is called once, from whatever freed or
    refused it (a release, the queue-wait timer, a bind's task)."""

    ticket: Ticket
    tenant: _Tenant
    deadline: float  # (monotonic) the queue wait bounds the wait for a slot
    granted: Callable[[Lease], None]
    failed: Callable[[Exception], None]
    # (monotonic) a worker start for it may be waited for until then: its arrival plus its
    # tenant's timeout (the queue wait at least)
    start_deadline: float = 0.0
    state: WaitState = WaitState.QUEUED
    timer: asyncio.TimerHandle | None = None
    task: asyncio.Task[None] | None = None

    @property
    def pending(self) -> bool:
        return self.state in (WaitState.QUEUED, WaitState.BINDING)


def outcome_of(reply: WorkerMessage) -> Outcome:
    """A worker's answer to a run, as the outcome its lease is released with."""
    if isinstance(reply, Refused):
        return Outcome.UNUSED  # not started: the worker is as it was
    if not isinstance(reply, Result):
        return Outcome.LOST
    return Outcome.DEVICE_ERROR if reply.host.device_error else Outcome.OK


