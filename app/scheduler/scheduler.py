"""Binds tenants to worker processes (their device contexts) on one node.

Rules (DESIGN.md section 1): a tenant's first call binds a warm spare; the binding stays while
the tenant is active; a tenant gets more workers as its concurrency needs, up to its
`max_concurrency`; when no worker is free the least recently used idle worker of another tenant
is evicted (killed and replaced, never handed over); a GPU binding is admitted only while the
bound caps plus per-context overhead fit the device. A worker that dies, overruns the hard
deadline or reports a device error is killed and replaced; only its own call fails.

Which call gets the node's next worker slot (per-tenant concurrency, the fair share of workers,
FIFO within a tenant) is decided by app/scheduler/fairness.py; this module runs the processes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from app.contract.errors import HardTimeout, NoCapacity, Rejected, RejectReason, WorkerCrashed
from app.contract.messages import Outcome, Usage, WorkerInfo
from app.scheduler.fairness import Blocked, FairShare, Ticket
from app.scheduler.leases import KernelSet, Lease, outcome_of
from app.scheduler.ratelimit import TokenBucket
from app.services.principal import TenantPrincipal
from app.settings import Settings
from app.worker.client import WorkerHandle, WorkerLost, WorkerState
from app.worker.forkserver import ForkServer
from app.worker.stats import stats_dir, sweep_stale_pages

log = logging.getLogger(__name__)

__all__ = ["HardTimeout", "KernelSet", "Lease", "NoCapacity", "Rejected", "Scheduler", "WorkerCrashed", "outcome_of"]


@dataclass
class _Tenant:
    principal: TenantPrincipal
    bucket: TokenBucket
    fair: FairShare  # holds the tenant's running count and queue, node-wide
    workers: list[WorkerHandle] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def running(self) -> int:
        return self.fair.running(self.principal.id)

    @property
    def waiters(self) -> deque[Ticket]:
        return self.fair.queue(self.principal.id)


_RETIRE_REASON = {
    Outcome.DEVICE_ERROR: "device_error",
    Outcome.LOST: "crashed",
    Outcome.HARD_TIMEOUT: "hard_timeout",
    Outcome.CANCELLED: "cancelled",
}


class Scheduler:
    def __init__(self, settings: Settings, secret: bytes = b"", run_dir: Path | None = None) -> None:
        """`secret` and `run_dir`: in a node of several fronts, the lease-token key given to every
        worker at bind and the private directory where workers listen for fronts' runs."""
        self.settings = settings
        self.secret = secret
        self.run_dir = run_dir
        self.leases: dict[str, Lease] = {}
        self._lease_seq = itertools.count(1)
        self._node_tag = uuid.uuid4().hex[:8]
        self.workers: list[WorkerHandle] = []
        self.tenants: dict[str, _Tenant] = {}
        self.restarts: Counter[str] = Counter()
        self.rejections: Counter[tuple[str, str]] = Counter()  # (tenant, reason)
        self.on_bind: Callable[[float], None] | None = None  # observes cold-start binding time
        self.device_budget = settings.device_memory_bytes
        self.fair = FairShare(settings.max_workers, settings.reserved_workers)
        self.backend = "unknown"
        self._changed = asyncio.Event()
        self._binders = 0
        self._start_failures = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.fork_server = ForkServer(settings.backend) if settings.fork_server else None

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self, wait: bool = True) -> None:
        sweep_stale_pages(stats_dir(self.settings.data_dir))  # left by a node that crashed
        self._ensure_spares()
        if wait and self.settings.warm_spares > 0:  # with no spares kept, nothing to wait for
            deadline = time.monotonic() + self.settings.worker_start_timeout_s
            while not any(w.state == WorkerState.SPARE for w in self.workers) and time.monotonic() < deadline:
                if not any(w.state == WorkerState.STARTING for w in self.workers):
                    self._ensure_spares()
                await self._wait_change(deadline)

    async def stop(self) -> None:
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*(w.close() for w in self.workers), return_exceptions=True)
        self.workers.clear()
        if self.fork_server is not None:
            self.fork_server.close_sync()

    def ready(self) -> bool:
        return any(w.state in (WorkerState.SPARE, WorkerState.IDLE, WorkerState.BUSY) for w in self.workers)

    # -- change notification --------------------------------------------------------------------
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NoCapacity("no worker became available in time")
        try:
            await asyncio.wait_for(self._changed.wait(), remaining)
        except TimeoutError:
            raise NoCapacity("no worker became available in time") from None

    # -- workers ------------------------------------------------------------------------------
    def _alive(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.state != WorkerState.DEAD]

    def _ensure_spares(self) -> None:
        if self._closed:
            return
        alive = self._alive()
        spares = sum(1 for w in alive if w.state in (WorkerState.SPARE, WorkerState.STARTING))
        want = self.settings.warm_spares + self._binders - spares
        room = self.settings.max_workers - len(alive)
        for _ in range(max(0, min(want, room))):
            self._spawn()

    def _spawn(self) -> None:
        w = WorkerHandle(self.settings, spawner=self.fork_server)
        if self.run_dir is not None:
            w.socket_path = str(self.run_dir / f"w-{w.id}.sock")
        self.workers.append(w)
        task = asyncio.get_running_loop().create_task(self._start_worker(w))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start_worker(self, w: WorkerHandle) -> None:
        try:
            await w.start()
            self._start_failures = 0
            watcher = asyncio.get_running_loop().create_task(self._watch(w))
            self._tasks.add(watcher)
            watcher.add_done_callback(self._tasks.discard)
            if self.backend == "unknown":  # every worker of a node runs the same backend
                self.backend = w.backend
                if not self.settings.device_memory_bytes and w.backend == "cuda":
                    self.device_budget = w.device.total_memory_bytes
        except Exception as exc:
            log.error("worker %s failed to start: %s", w.id, exc)
            self._start_failures += 1
            self._drop(w, "start_failed")
            await asyncio.sleep(min(5.0, 0.2 * 2**self._start_failures))
            self._ensure_spares()
        finally:
            self._notify()

    async def _watch(self, w: WorkerHandle) -> None:
        assert w.proc is not None
        await w.proc.wait()
        if w.state not in (WorkerState.DEAD, WorkerState.BUSY):  # a busy worker's death is handled by its call
            self._retire(w, "exited")

    def _drop(self, w: WorkerHandle, reason: str) -> None:
        w.kill()
        if w in self.workers:
            self.workers.remove(w)
        for ts in self.tenants.values():
            if w in ts.workers:
                ts.workers.remove(w)
        self.restarts[reason] += 1
        task = asyncio.get_running_loop().create_task(w.close())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _retire(self, w: WorkerHandle, reason: str) -> None:
        if w not in self.workers:
            return  # already replaced (a call and the watcher may both notice a death)
        log.info("replacing worker %s (tenant %s): %s", w.id, w.tenant_name, reason)
        self._drop(w, reason)
        self._ensure_spares()
        self._notify()

    def committed_bytes(self) -> int:
        overhead = self.settings.context_overhead_bytes
        return sum(overhead + (w.gpu_cap if w.tenant_id else 0) for w in self._alive())

    def _admits(self, cap: int) -> bool:
        if self.backend != "cuda" or not self.device_budget:
            return True
        return self.committed_bytes() + cap <= self.device_budget

    def _evict_one(self, exclude: str) -> bool:
        idle = [w for w in self.workers if w.state == WorkerState.IDLE and w.tenant_id != exclude]
        if not idle:
            return False
        self._retire(min(idle, key=lambda w: w.last_used), "evicted")
        return True

    async def _acquire_worker(self, ts: _Tenant) -> WorkerHandle:
        cap = ts.principal.quota.gpu_memory_bytes
        if self.backend == "cuda" and self.device_budget and cap + self.settings.context_overhead_bytes > self.device_budget:
            raise NoCapacity(f"the tenant's GPU cap ({cap} bytes) does not fit this node's device")
        deadline = time.monotonic() + self.settings.worker_start_timeout_s
        t_acquire = time.perf_counter()
        self._binders += 1
        try:
            while True:
                for w in ts.workers:
                    if w.state == WorkerState.IDLE:
                        if w.gpu_cap != cap:  # quota changed since the binding
                            self._retire(w, "quota_changed")
                            break
                        w.state = WorkerState.BUSY
                        return w
                else:
                    spare = next((w for w in self.workers if w.state == WorkerState.SPARE), None)
                    if spare is not None and self._admits(cap):
                        spare.state = WorkerState.BINDING
                        try:
                            await spare.bind(ts.principal.id, ts.principal.name, cap, self.secret)
                        except WorkerLost:
                            self._retire(spare, "crashed")
                            continue
                        except BaseException:  # cancelled mid-bind: its reply would be orphaned
                            self._retire(spare, "cancelled")
                            raise
                        if self.on_bind is not None:
                            self.on_bind(time.perf_counter() - t_acquire)  # waiting for a spare included
                        spare.state = WorkerState.BUSY
                        ts.workers.append(spare)
                        # Refill once this call has answered: spawning a process forks the api
                        # process, which would otherwise land inside the cold call it serves.
                        asyncio.get_running_loop().call_later(0.01, self._ensure_spares)
                        return spare
                    starting = sum(1 for w in self.workers if w.state == WorkerState.STARTING)
                    full = len(self._alive()) >= self.settings.max_workers
                    if (full and starting == 0) or (spare is not None and not self._admits(cap)):
                        self._evict_one(exclude=ts.principal.id)
                    self._ensure_spares()
                    await self._wait_change(deadline)
        finally:
            self._binders -= 1

    # -- per-tenant admission -------------------------------------------------------------------
    def _tenant(self, principal: TenantPrincipal) -> _Tenant:
        ts = self.tenants.get(principal.id)
        if ts is None or ts.bucket.rate != principal.quota.requests_per_second:
            ts_new = _Tenant(principal, TokenBucket(principal.quota.requests_per_second), self.fair)
            if ts is not None:
                ts_new.workers = ts.workers
            ts = self.tenants[principal.id] = ts_new
        ts.principal = principal
        return ts

    @staticmethod
    def _wake(granted: list[Ticket]) -> None:
        for ticket in granted:
            if ticket.waker is not None and not ticket.waker.done():
                ticket.waker.set_result(None)

    async def _enter(self, ts: _Tenant) -> Ticket:
        """Wait for a worker slot: the tenant's concurrency and the fair share allow a call."""
        tid, limit = ts.principal.id, ts.principal.quota.max_concurrency
        if len(self.fair.queue(tid)) >= self.settings.queue_limit:
            self.rejections[(ts.principal.name, "queue_full")] += 1
            raise Rejected(RejectReason.QUEUE_FULL, f"tenant is at its concurrency limit ({limit}) and its queue is full", 1)
        ticket, granted = self.fair.submit(tid, limit)
        self._wake(granted)
        if ticket.granted:
            return ticket
        ticket.waker = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(self.settings.queue_wait_ms / 1000):
                await ticket.waker
        except TimeoutError:
            if ticket.granted:  # granted as the wait ran out: keep it
                return ticket
            blocked = self.fair.blocked(tid)
            self._wake(self.fair.withdraw(ticket))
            raise self._refusal(ts, blocked) from None
        except BaseException:  # the caller went away while queued: give back what it holds
            self._wake(self.fair.withdraw(ticket))
            raise
        return ticket

    def _refusal(self, ts: _Tenant, blocked: Blocked) -> Exception:
        name, limit = ts.principal.name, ts.principal.quota.max_concurrency
        if blocked == Blocked.CONCURRENCY:
            self.rejections[(name, "concurrency")] += 1
            return Rejected(RejectReason.CONCURRENCY, f"tenant is at its concurrency limit ({limit} running); retry shortly", 1)
        if blocked == Blocked.FAIR_SHARE:
            self.rejections[(name, "fair_share")] += 1
            return Rejected(
                RejectReason.FAIR_SHARE,
                f"tenant runs {self.fair.share} invocations, its share of this node's {self.fair.max_workers} workers "
                "(the rest are kept for other tenants); retry shortly",
                1,
            )
        return NoCapacity("every worker of this node is busy")

    def _leave(self, ticket: Ticket) -> None:
        self._wake(self.fair.release(ticket))

    def check_rate(self, principal: TenantPrincipal) -> None:
        """Take one call from the tenant's token bucket, or raise Rejected (rate)."""
        self._take_rate(self._tenant(principal))

    def _take_rate(self, ts: _Tenant) -> None:
        principal = ts.principal
        wait = ts.bucket.take()
        if wait > 0:
            self.rejections[(principal.name, "rate")] += 1
            raise Rejected(
                RejectReason.RATE,
                f"tenant exceeded its rate of {principal.quota.requests_per_second:g} invocations per second",
                TokenBucket.retry_after(wait),
            )

    def tenant_changed(self, tenant_id: str) -> None:
        """After an admin change: no worker keeps serving a tenant on stale settings."""
        ts = self.tenants.pop(tenant_id, None)
        if ts is None:
            return
        for w in list(ts.workers):
            if w.state == WorkerState.IDLE:
                self._retire(w, "tenant_changed")
            else:
                w.retire_reason = "tenant_changed"

    # -- the call: lease, exchange (by the caller), release ----------------------------------
    async def lease(self, principal: TenantPrincipal, check_rate: bool = False) -> Lease:
        """Admit one call of the tenant (rate when asked, concurrency, fair share, queue) and
        hold a worker bound to it for the call. The caller must `release` the lease."""
        lease = self.lease_now(principal, check_rate)
        if lease is not None:
            return lease
        ts = self._tenant(principal)
        ticket = await self._enter(ts)
        try:
            w = await self._acquire_worker(ts)
        except BaseException:
            self._leave(ticket)
            raise
        ts.last_used = time.monotonic()
        return self._grant(w, ts, ticket)

    def lease_now(self, principal: TenantPrincipal, check_rate: bool = False) -> Lease | None:
        """The lease without waiting, when the tenant may start a call now and has an idle
        worker (a warm tenant's usual call): no task, no event-loop turn. None: call `lease`
        (with check_rate=False: the rate was taken here)."""
        ts = self._tenant(principal)
        if check_rate:
            self._take_rate(ts)
        if ts.waiters:
            return None  # FIFO: those queued go first
        cap = principal.quota.gpu_memory_bytes
        w = next((w for w in ts.workers if w.state == WorkerState.IDLE and w.gpu_cap == cap), None)
        if w is None:
            return None
        ticket, granted = self.fair.submit(principal.id, principal.quota.max_concurrency)
        self._wake(granted)
        if not ticket.granted:
            self.fair.withdraw(ticket)
            return None
        w.state = WorkerState.BUSY
        ts.last_used = time.monotonic()
        return self._grant(w, ts, ticket)

    def _grant(self, w: WorkerHandle, ts: _Tenant, ticket: Ticket) -> Lease:
        # unique on this node is enough: a front proves its lease with the token, not the id
        lease = Lease(f"{self._node_tag}-{next(self._lease_seq):x}", w, ts, ticket, w.kernels_version)
        self.leases[lease.id] = lease
        return lease

    def release(self, lease: Lease, outcome: Outcome, kernels_version: str = "") -> None:
        """Give the worker back: idle again after a clean call, replaced after anything else."""
        if lease.released:
            return
        lease.released = True
        self.leases.pop(lease.id, None)
        w = lease.worker
        try:
            if outcome in (Outcome.OK, Outcome.DEVICE_ERROR):
                w.kernels_version = kernels_version
                w.invocations += 1
                w.last_used = time.monotonic()
            if outcome == Outcome.OK and not w.retire_reason and w.state == WorkerState.BUSY:
                w.state = WorkerState.IDLE
                self._notify()
            elif outcome == Outcome.OK:
                self._retire(w, w.retire_reason or "exited")
            else:
                self._retire(w, _RETIRE_REASON[outcome])
        finally:
            self._leave(lease.ticket)

    # -- views --------------------------------------------------------------------------------
    def usage(self, tenant_id: str) -> Usage:
        ts = self.tenants.get(tenant_id)
        if ts is None:
            return Usage(running=self.fair.running(tenant_id), queued=len(self.fair.queue(tenant_id)), workers=0, gpu_bytes_in_use=0)
        return Usage(
            running=ts.running,
            queued=len(ts.waiters),
            workers=len(ts.workers),
            gpu_bytes_in_use=sum(w.live_stats().get("gpu_bytes_in_use", 0) for w in ts.workers),
        )

    def tenant_usage(self, tenant_id: str) -> dict[str, int]:
        return msgspec.structs.asdict(self.usage(tenant_id))

    def worker_infos(self) -> list[WorkerInfo]:
        return [
            WorkerInfo(
                id=w.id,
                pid=w.pid,
                state=w.state.value,
                backend=w.backend,
                tenant_id=w.tenant_id,
                tenant=w.tenant_name,
                gpu_bytes_in_use=w.live_stats().get("gpu_bytes_in_use", 0),
                gpu_bytes_cap=w.gpu_cap,
                invocations=w.invocations,
                started_at=w.started_at.isoformat(),
                compute_capability=w.device.compute_capability,
            )
            for w in self.workers
        ]

    def queue_depth(self) -> int:
        return self.fair.queued()
