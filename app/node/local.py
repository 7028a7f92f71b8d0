"""The node of one process: the scheduler runs in the api process and calls go over pipes."""

from __future__ import annotations

import asyncio
from typing import cast

from app.contract.messages import ChangeKind, Outcome, Principal, Readiness, Usage, WorkerInfo
from app.node.port import CallLease
from app.observability.phases import ADMIT, clock, lap
from app.scheduler.leases import Lease
from app.scheduler.scheduler import Scheduler


class LocalNode:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    async def lease(self, principal: Principal, hard_timeout_s: float, traceparent: str | None, check_rate: bool) -> Lease:
        t = clock()
        lease = self.scheduler.lease_now(principal, check_rate)  # a warm tenant's usual call: no wait
        if lease is not None:
            lap(ADMIT, t)
            return lease
        return await self.scheduler.lease(principal)  # waits for a slot or a worker (its rate was taken)

    def release(self, lease: CallLease, outcome: Outcome, kernels_version: str) -> None:
        self.scheduler.release(cast(Lease, lease), outcome, kernels_version)

    def routed(self, tenant_id: str) -> bool:
        return True  # the scheduler is in this process: a lease asked early would save nothing

    def turn_ahead(self, tenant_id: str) -> asyncio.Future[None] | None:
        return None

    def turn(self, lease: CallLease) -> asyncio.Future[None] | None:
        return None  # one process serves every call through its scheduler's own queue

    def stop(self, lease: CallLease, within_s: float, kernels_version: str) -> None:
        # the worker's pipe carries its control messages too: nothing reaches a running guest
        # on it, so the worker is replaced (its reply would be orphaned)
        self.release(lease, Outcome.CANCELLED, kernels_version)

    async def check_rate(self, principal: Principal) -> None:
        self.scheduler.check_rate(principal)

    async def usage(self, tenant_id: str) -> Usage:
        return self.scheduler.usage(tenant_id)

    async def workers(self) -> list[WorkerInfo]:
        return self.scheduler.worker_infos()

    async def readiness(self) -> Readiness:
        return self.scheduler.readiness()

    async def flush_records(self) -> None:
        return None

    async def metrics_text(self) -> bytes:
        return b""

    def announce(self, kind: ChangeKind, tenant_id: str, name: str = "") -> None:
        return None  # no other front

    async def publish(self, kind: ChangeKind, tenant_id: str, name: str = "") -> None:
        if kind == ChangeKind.TENANT:
            self.scheduler.tenant_changed(tenant_id)
