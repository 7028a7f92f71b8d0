"""Binds tenants to worker processes (their device contexts) on one node.

Rules (DESIGN.md section 1): a tenant's first call binds a warm spare; the binding stays while
the tenant is active; a tenant gets more workers as its concurrency needs, up to its
`max_concurrency`; when no worker is free the least recently used idle worker of another tenant
is evicted (killed and replaced, never handed over); a GPU binding is admitted only while the
bound caps plus per-context overhead fit the device. A worker that dies, overruns the hard
deadline or reports a device error is killed and replaced; only its own call fails.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.scheduler.ratelimit import TokenBucket
from app.services.principal import TenantPrincipal
from app.settings import Settings
from app.worker.client import WorkerHandle, WorkerLost
from app.worker.forkserver import ForkServer

log = logging.getLogger(__name__)


class Rejected(Exception):
    """The call was not run; the caller may retry after `retry_after` seconds."""

    def __init__(self, reason: str, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.reason = reason  # concurrency | queue_full | rate
        self.message = message
        self.retry_after = retry_after


class NoCapacity(Exception):
    """No worker could be bound for this tenant in time (node full or GPU admission)."""


class HardTimeout(Exception):
    pass


class WorkerCrashed(Exception):
    pass


@dataclass
class KernelSet:
    version: int
    sources: dict[str, str]


@dataclass
class _Tenant:
    principal: TenantPrincipal
    bucket: TokenBucket
    running: int = 0
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)
    workers: list[WorkerHandle] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)


class Scheduler:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.workers: list[WorkerHandle] = []
        self.tenants: dict[str, _Tenant] = {}
        self.restarts: Counter[str] = Counter()
        self.rejections: Counter[tuple[str, str]] = Counter()  # (tenant, reason)
        self.on_bind: Callable[[float], None] | None = None  # observes cold-start binding time
        self.device_budget = settings.device_memory_bytes
        self.backend = "unknown"
        self._changed = asyncio.Event()
        self._binders = 0
        self._start_failures = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.fork_server = ForkServer(settings.backend) if settings.fork_server else None

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self, wait: bool = True) -> None:
        self._ensure_spares()
        if wait and self.settings.warm_spares > 0:  # with no spares kept, nothing to wait for
            deadline = time.monotonic() + self.settings.worker_start_timeout_s
            while not any(w.state == "spare" for w in self.workers) and time.monotonic() < deadline:
                if not any(w.state == "starting" for w in self.workers):
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
        return any(w.state in ("spare", "idle", "busy") for w in self.workers)

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
        return [w for w in self.workers if w.state != "dead"]

    def _ensure_spares(self) -> None:
        if self._closed:
            return
        alive = self._alive()
        spares = sum(1 for w in alive if w.state in ("spare", "starting"))
        want = self.settings.warm_spares + self._binders - spares
        room = self.settings.max_workers - len(alive)
        for _ in range(max(0, min(want, room))):
            self._spawn()

    def _spawn(self) -> None:
        w = WorkerHandle(self.settings, spawner=self.fork_server)
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
                    self.device_budget = int(w.device.get("total_memory_bytes", 0))
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
        if w.state not in ("dead", "busy"):  # a busy worker's death is handled by its call
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
        idle = [w for w in self.workers if w.state == "idle" and w.tenant_id != exclude]
        if not idle:
            return False
        self._retire(min(idle, key=lambda w: w.last_used), "evicted")
        return True

    async def _acquire_worker(self, ts: _Tenant, kernels: KernelSet) -> WorkerHandle:
        cap = ts.principal.quota.gpu_memory_bytes
        if self.backend == "cuda" and self.device_budget and cap + self.settings.context_overhead_bytes > self.device_budget:
            raise NoCapacity(f"the tenant's GPU cap ({cap} bytes) does not fit this node's device")
        deadline = time.monotonic() + self.settings.worker_start_timeout_s
        t_acquire = time.perf_counter()
        self._binders += 1
        try:
            while True:
                for w in ts.workers:
                    if w.state == "idle":
                        if w.gpu_cap != cap:  # quota changed since the binding
                            self._retire(w, "quota_changed")
                            break
                        w.state = "busy"
                        return w
                else:
                    spare = next((w for w in self.workers if w.state == "spare"), None)
                    if spare is not None and self._admits(cap):
                        spare.state = "binding"
                        try:
                            await spare.bind(ts.principal.id, ts.principal.name, cap, kernels.sources, kernels.version)
                        except WorkerLost:
                            self._retire(spare, "crashed")
                            continue
                        except BaseException:  # cancelled mid-bind: its reply would be orphaned
                            self._retire(spare, "cancelled")
                            raise
                        if self.on_bind is not None:
                            self.on_bind(time.perf_counter() - t_acquire)  # waiting for a spare included
                        spare.state = "busy"
                        ts.workers.append(spare)
                        # Refill once this call has answered: spawning a process forks the api
                        # process, which would otherwise land inside the cold call it serves.
                        asyncio.get_running_loop().call_later(0.01, self._ensure_spares)
                        return spare
                    starting = sum(1 for w in self.workers if w.state == "starting")
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
            ts_new = _Tenant(principal, TokenBucket(principal.quota.requests_per_second))
            if ts is not None:
                ts_new.running, ts_new.waiters, ts_new.workers = ts.running, ts.waiters, ts.workers
            ts = self.tenants[principal.id] = ts_new
        ts.principal = principal
        return ts

    async def _enter(self, ts: _Tenant) -> None:
        limit = ts.principal.quota.max_concurrency
        if ts.running < limit and not ts.waiters:
            ts.running += 1
            return
        if len(ts.waiters) >= self.settings.queue_limit:
            self.rejections[(ts.principal.name, "queue_full")] += 1
            raise Rejected("queue_full", f"tenant is at its concurrency limit ({limit}) and its queue is full", 1)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ts.waiters.append(fut)
        try:
            done, _ = await asyncio.wait({fut}, timeout=self.settings.queue_wait_ms / 1000)
        except asyncio.CancelledError:  # the caller went away while queued
            if fut.done():
                self._leave(ts)  # a slot was already handed to us: pass it on
            else:
                ts.waiters.remove(fut)
                fut.cancel()
            raise
        if not done:
            ts.waiters.remove(fut)
            fut.cancel()
            self.rejections[(ts.principal.name, "concurrency")] += 1
            raise Rejected(
                "concurrency",
                f"tenant is at its concurrency limit ({limit} running); retry shortly",
                1,
            )
        # the slot was handed over by _leave: running already counts it

    def _leave(self, ts: _Tenant) -> None:
        while ts.waiters:
            fut = ts.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        ts.running -= 1

    def check_rate(self, principal: TenantPrincipal) -> None:
        wait = self._tenant(principal).bucket.take()
        if wait > 0:
            self.rejections[(principal.name, "rate")] += 1
            raise Rejected(
                "rate",
                f"tenant exceeded its rate of {principal.quota.requests_per_second:g} invocations per second",
                TokenBucket.retry_after(wait),
            )

    def tenant_changed(self, tenant_id: str) -> None:
        """After an admin change: no worker keeps serving a tenant on stale settings."""
        ts = self.tenants.pop(tenant_id, None)
        if ts is None:
            return
        for w in list(ts.workers):
            if w.state == "idle":
                self._retire(w, "tenant_changed")
            else:
                w.retire_reason = "tenant_changed"

    # -- the call -----------------------------------------------------------------------------
    async def run(
        self, principal: TenantPrincipal, header: dict[str, Any], body: bytes, hard_timeout_s: float, kernels: KernelSet,
        on_chunk: Callable[[bytes], None] | None = None,
    ) -> tuple[dict[str, Any], bytes, WorkerHandle]:
        """Run one call on a worker of the tenant. With `on_chunk` (and `stream` in the header)
        the guest's stdout arrives there as written. Cancelling the caller kills the worker."""
        self.check_rate(principal)
        ts = self._tenant(principal)
        await self._enter(ts)
        try:
            w = await self._acquire_worker(ts, kernels)
            ts.last_used = time.monotonic()
            if w.kernels_version != kernels.version:
                header = {**header, "kernels": kernels.sources}
            try:
                async with asyncio.timeout(hard_timeout_s):  # no extra task, unlike wait_for
                    reply, out = await w.request(header, body, on_chunk)
            except TimeoutError:
                self._retire(w, "hard_timeout")
                raise HardTimeout() from None
            except WorkerLost:
                self._retire(w, "crashed")
                raise WorkerCrashed() from None
            except BaseException:  # cancelled mid-call: the worker's reply would be orphaned
                self._retire(w, "cancelled")
                raise
            w.kernels_version = kernels.version
            w.invocations += 1
            w.last_used = time.monotonic()
            if reply.get("host", {}).get("device_error"):
                self._retire(w, "device_error")
            elif w.retire_reason:
                self._retire(w, w.retire_reason)
            else:
                w.state = "idle"
                self._notify()
            return reply, out, w
        finally:
            self._leave(ts)

    # -- views --------------------------------------------------------------------------------
    def tenant_usage(self, tenant_id: str) -> dict[str, int]:
        ts = self.tenants.get(tenant_id)
        if ts is None:
            return {"running": 0, "queued": 0, "workers": 0, "gpu_bytes_in_use": 0}
        return {
            "running": ts.running,
            "queued": len(ts.waiters),
            "workers": len(ts.workers),
            "gpu_bytes_in_use": sum(w.live_stats().get("gpu_bytes_in_use", 0) for w in ts.workers),
        }

    def queue_depth(self) -> int:
        return sum(len(ts.waiters) for ts in self.tenants.values())
