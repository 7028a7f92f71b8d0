"""What the HTTP side needs from the node's scheduler, whether it runs in-process or in the
supervisor: leases, rate checks, views and admin changes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from app.contract.frames import Payload
from app.contract.messages import ChangeKind, Outcome, Principal, Readiness, Run, Usage, WorkerInfo, WorkerMessage


class CallLease(Protocol):
    """A worker held for one call."""

    @property
    def kernels_version(self) -> str: ...

    @property
    def wait_s(self) -> float:
        """How long the call may wait at its worker before it starts (0: the worker is its alone)."""
        ...

    async def exchange(self, run: Run, body: bytes, on_chunk: Callable[[Payload], None] | None = None) -> tuple[WorkerMessage, Payload]:
        """Send the run, return the worker's last frame (a Result) and its body; the Chunk frames
        of a streamed run go to `on_chunk` as they come. Raises WorkerLost."""
        ...


class NodePort(Protocol):
    async def lease(
        self, principal: Principal, hard_timeout_s: float, traceparent: str | None, check_rate: bool
    ) -> CallLease: ...

    def release(self, lease: CallLease, outcome: Outcome, kernels_version: str) -> None: ...

    def routed(self, tenant_id: str) -> bool:
        """Whether a call of the tenant finds a worker of its own without the supervisor's help
        (False: its lease binds a spare or waits for a start)."""
        ...

    def turn_ahead(self, tenant_id: str) -> asyncio.Future[None] | None:
        """Before a call's lookup and admission: a future to wait for first when its tenant
        queues in this front and a light tenant's call is here, or None to go on at once."""
        ...

    def turn(self, lease: CallLease) -> asyncio.Future[None] | None:
        """A future the call waits for before it goes on (it queued at its worker and a call of a
        tenant that does not queue is in this front), or None to go on at once."""
        ...

    def stop(self, lease: CallLease, within_s: float, kernels_version: str) -> None:
        """The caller went away while its run was on the worker: stop the guest and release the
        lease once the worker answers, the worker kept (within `within_s`, else replaced)."""
        ...

    async def check_rate(self, principal: Principal) -> None: ...

    async def usage(self, tenant_id: str) -> Usage: ...

    async def workers(self) -> list[WorkerInfo]: ...

    async def readiness(self) -> Readiness: ...

    async def flush_records(self) -> None:
        """Every other front of the node writes its batched invocation records (no-op in a
        one-process node)."""
        ...

    async def metrics_text(self) -> bytes:
        """The scheduler's own metric families, in Prometheus text (empty when in-process:
        then they are in the app's registry)."""
        ...

    def announce(self, kind: ChangeKind, tenant_id: str, name: str = "") -> None:
        """A hint for every other front (async work queued or cancelled), not waited for."""
        ...

    async def publish(self, kind: ChangeKind, tenant_id: str, name: str = "") -> None:
        """An admin change made on this front: returns once the scheduler and every other front
        have applied it (a front that does not answer within 2 s is not waited for)."""
        ...
