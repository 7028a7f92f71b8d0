"""What a call holds while it runs: a lease on one worker, and the kernel set it may carry."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.contract.messages import Outcome, Result, Run, WorkerMessage

if TYPE_CHECKING:
    from app.scheduler.fairness import Ticket
    from app.scheduler.scheduler import _Tenant
    from app.worker.client import WorkerHandle


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

    async def exchange(self, run: Run, body: bytes, on_chunk: Callable[[bytes], None] | None = None) -> tuple[WorkerMessage, bytes]:
        """In a one-process node the call goes over the worker's pipe."""
        return await self.worker.request(run, body, on_chunk)


def outcome_of(reply: WorkerMessage) -> Outcome:
    """A worker's answer to a run, as the outcome its lease is released with."""
    if not isinstance(reply, Result):
        return Outcome.LOST
    return Outcome.DEVICE_ERROR if reply.host.device_error else Outcome.OK


