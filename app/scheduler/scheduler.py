"""Binds tenants to worker processes (their device contexts) on one node.

Rules (DESIGN.md section 1): a tenant's first call binds a warm spare; the binding stays while
the tenant is active; a tenant gets more workers as its concurrency needs, up to its
`max_concurrency` and its fair share of the node; when no worker is free the least recently
used idle worker of another tenant is evicted (killed and replaced, never handed over); a GPU
binding is admitted only while the bound caps plus per-context overhead fit its device. A worker that dies, overruns the hard
deadline or reports a device error is killed and replaced; only its own call fails.

Devices (app/scheduler/devices.py decides, this module acts): every GPU of the node is used, each
worker pinned to one through its own CUDA_VISIBLE_DEVICES. `warm_spares` spares are kept per
device, so the device a new tenant is placed on (the most free budget below its ceiling) has a
spare ready, and a node with more GPUs keeps more ready; at most `max_parallel_starts` workers
start at once (the driver serialises context creation anyway); a failed start backs its device
off exponentially, and a context the driver refuses sets that device's ceiling: no start loop.
When every worker slot is bound, the least recently used workers of tenants idle past
`retire_idle_after_s` are retired in the background, several at once, so spares are ready before
the next new tenants arrive. The queue wait bounds a call's whole wait (a slot, then a worker):
past it, NoCapacity.

A call holds a `Lease` from `lease` to `release`; the caller (a front, or the one-process api)
exchanges the call's bytes with the worker itself.

Which call gets the node's next worker slot (per-tenant concurrency, the fair share of workers,
FIFO within a tenant) is decided by app/scheduler/fairness.py; this module runs the processes.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import msgspec

from app.contract.errors import HardTimeout, NoCapacity, Rejected, RejectReason, WorkerCrashed
from app.contract.messages import DeviceView, Outcome, Readiness, Usage, WorkerInfo
from app.gpu.probe import probe
from app.scheduler.devices import Device, Inventory
from app.scheduler.fairness import Blocked, FairShare, Ticket
from app.scheduler.leases import KernelSet, Lease, Waiting, WaitState, outcome_of
from app.scheduler.ratelimit import TokenBucket
from app.services.principal import TenantPrincipal
from app.settings import Settings
from app.worker.client import StartRefused, WorkerHandle, WorkerLost, WorkerState
from app.worker.forkserver import ForkServer
from app.worker.stats import stats_dir, sweep_stale_pages

log = logging.getLogger(__name__)

__all__ = ["HardTimeout", "KernelSet", "Lease", "NoCapacity", "Rejected", "Scheduler", "WorkerCrashed", "outcome_of"]

MAINTENANCE_S = 0.5  # how often spares, back-offs and the slot kept ahead of need are looked at


async def discover_devices(settings: Settings) -> Inventory:
    """The node's devices: the GPUs a probe process sees (this process never touches CUDA), or
    one CPU device. Each GPU's budget is `device_memory_bytes`, or its total when that is 0."""
    overhead, ceiling = settings.context_overhead_bytes, settings.max_contexts_per_device
    if settings.backend == "cpu":
        return Inventory.cpu(overhead, ceiling)
    gpus = await probe(settings.worker_start_timeout_s)
    if not gpus:
        if settings.backend == "cuda":  # the workers will fail to start and say why
            log.error("backend cuda, but no GPU was found: workers start unpinned")
        return Inventory.cpu(overhead, ceiling)
    return Inventory(
        [Device(g.index, g.visible_id, settings.device_memory_bytes or g.total_memory_bytes, g.name, ceiling) for g in gpus],
        overhead,
    )


class _Progress(Enum):
    """What getting a spare for a waiting call has under way."""

    PENDING = 1  # a start that may serve it: wait for a change
    AGAIN = 2  # room was made just now: look again at once
    NONE = 3  # nothing: every device at its ceiling, budget or back-off, nothing idle to evict


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
    def __init__(
        self, settings: Settings, secret: bytes = b"", run_dir: Path | None = None, devices: Inventory | None = None,
        discover: Callable[[Settings], Awaitable[Inventory]] | None = None,
    ) -> None:
        """`secret` and `run_dir`: in a node of several fronts, the lease-token key given to every
        worker at bind and the private directory where workers listen for fronts' runs. `devices`:
        the node's devices as given (tests); else found at start by `discover`."""
        self.settings = settings
        self.secret = secret
        self.run_dir = run_dir
        self._lease_seq = itertools.count(1)
        self._node_tag = uuid.uuid4().hex[:8]
        self.workers: list[WorkerHandle] = []
        self.tenants: dict[str, _Tenant] = {}
        self.restarts: Counter[str] = Counter()
        self.rejections: Counter[tuple[str, str]] = Counter()  # (tenant, reason)
        self.on_bind: Callable[[float], None] | None = None  # observes cold-start binding time
        self.on_start: Callable[[float], None] | None = None  # observes a worker's start, fork to ready
        # a call waits for a worker none of its tenant's can serve: whoever keeps idle leases
        # busy (a supervisor's fronts) must give them back, or the call waits for their end
        self.on_worker_wait: Callable[[], None] | None = None
        self.devices = devices or Inventory.cpu(settings.context_overhead_bytes, settings.max_contexts_per_device)
        self._discover = None if devices is not None else (discover or discover_devices)
        self.fair = FairShare(settings.max_workers, settings.reserved_workers)
        self.backend = "unknown"
        self._changed = asyncio.Event()
        self._binders = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.fork_server = ForkServer(settings.backend) if settings.fork_server else None

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self, wait: bool = True) -> None:
        sweep_stale_pages(stats_dir(self.settings.data_dir))  # left by a node that crashed
        if self._discover is not None:
            self.devices = await self._discover(self.settings)
            self._discover = None
            log.info("devices: %s", ", ".join(f"{d.index} {d.name} ({d.budget_bytes >> 20} MiB)" for d in self.devices.devices))
        self._background(self._maintain())
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
        """A worker is ready and some device is not backing off (starts failing everywhere)."""
        return self.devices.usable() and any(w.state in (WorkerState.SPARE, WorkerState.IDLE, WorkerState.BUSY) for w in self.workers)

    def _background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _maintain(self) -> None:
        """Spares after a device's back-off ends, and a slot freed ahead of need once every slot
        is bound; both also happen on each start, bind and retirement."""
        while not self._closed:
            await asyncio.sleep(MAINTENANCE_S)
            self._ensure_spares()

    # -- change notification --------------------------------------------------------------------
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, deadline: float, why: str = "no worker became available in time") -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NoCapacity(why)
        try:
            await asyncio.wait_for(self._changed.wait(), remaining)
        except TimeoutError:
            raise NoCapacity(why) from None

    # -- workers ------------------------------------------------------------------------------
    def _alive(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.state != WorkerState.DEAD]

    def _starting(self) -> int:
        return sum(1 for w in self.workers if w.state == WorkerState.STARTING)

    def _start_slots(self) -> int:
        """Workers that may start now: worker slots free, within the parallel-start bound."""
        room = self.settings.max_workers - len(self._alive())
        return max(0, min(room, self.settings.max_parallel_starts - self._starting()))

    def _ensure_spares(self) -> None:
        """`warm_spares` spare or starting workers on each device that may start one."""
        if self._closed:
            return
        have = Counter(w.device_index for w in self._alive() if w.state in (WorkerState.SPARE, WorkerState.STARTING))
        slots = self._start_slots()
        while slots > 0:
            short = [d for d in self.devices.devices if have[d.index] < self.settings.warm_spares and self.devices.can_start(d)]
            if not short:
                break
            d = min(short, key=lambda d: (have[d.index], -(d.free_bytes() or 0), d.index))
            self._spawn(d)
            have[d.index] += 1
            slots -= 1
        self._free_slot_ahead()

    def _free_slot_ahead(self) -> None:
        """Every slot bound (the node's workers, or every device at its ceiling or budget) and
        fewer spares on the way than `warm_spares` per device: retire the least recently used
        workers of tenants with nothing running or queued (idle past `retire_idle_after_s`), so
        that the next new tenants find spares (their replacements). Several at once: the driver
        creates contexts one after another, and a pipeline of starts keeps it busy."""
        alive = self._alive()
        if self.settings.warm_spares <= 0 or not (len(alive) >= self.settings.max_workers or self.devices.all_full()):
            return
        if not self.devices.usable():  # every device backing off: no replacement would start
            return
        coming = sum(1 for w in alive if w.state in (WorkerState.SPARE, WorkerState.STARTING, WorkerState.BINDING))
        want = min(self.settings.warm_spares * len(self.devices.devices), self.settings.max_parallel_starts) - coming
        if want <= 0:
            return
        quiet_since = time.monotonic() - self.settings.retire_idle_after_s
        idle = [
            w for w in alive
            if w.state == WorkerState.IDLE and w.tenant_id is not None and w.last_used <= quiet_since
            and self.fair.running(w.tenant_id) == 0 and not self.fair.queue(w.tenant_id)
        ]
        for w in sorted(idle, key=lambda w: w.last_used)[:want]:
            self._retire(w, "evicted")

    def _spawn(self, device: Device) -> WorkerHandle:
        w = WorkerHandle(self.settings, spawner=self.fork_server, device_index=device.index, visible_device=device.visible_id)
        if self.run_dir is not None:
            w.socket_path = str(self.run_dir / f"w-{w.id}.sock")
        self.workers.append(w)
        self.devices.context_started(device)
        self._background(self._start_worker(w))
        return w

    async def _start_worker(self, w: WorkerHandle) -> None:
        device = self.devices[w.device_index]
        t0 = time.perf_counter()
        try:
            await w.start()
            if self.on_start is not None:
                self.on_start(time.perf_counter() - t0)
            self.devices.start_ok(device)
            self._background(self._watch(w))
            if self.backend == "unknown":  # every worker of a node runs the same backend
                self.backend = w.backend
        except StartRefused as exc:
            self._drop(w, "start_refused")  # first: the ceiling is what the device holds without it
            delay = self.devices.learn_refusal(device)
            log.warning("device %d refused a context (%s); its ceiling is now %d", device.index, exc, device.ceiling)
            if delay:
                self._after(delay)
        except Exception as exc:
            log.error("worker %s failed to start on device %d: %s", w.id, device.index, exc)
            self._drop(w, "start_failed")
            self._after(self.devices.start_failed(device))
        finally:
            self._notify()
        self._ensure_spares()  # a start slot is free

    def _after(self, delay: float) -> None:
        """Look again once a device's back-off has run out (waiting calls too)."""
        def again() -> None:
            self._ensure_spares()
            self._notify()

        asyncio.get_running_loop().call_later(delay + 0.01, again)

    async def _watch(self, w: WorkerHandle) -> None:
        assert w.proc is not None
        await w.proc.wait()
        if w.state not in (WorkerState.DEAD, WorkerState.BUSY):  # a busy worker's death is handled by its call
            self._retire(w, "exited")

    def _drop(self, w: WorkerHandle, reason: str) -> None:
        w.kill()
        if w in self.workers:
            self.workers.remove(w)
            self.devices.context_ended(self.devices[w.device_index], w.gpu_cap if w.tenant_id else 0)
        for ts in self.tenants.values():
            if w in ts.workers:
                ts.workers.remove(w)
        self.restarts[reason] += 1
        self._background(w.close())

    def _retire(self, w: WorkerHandle, reason: str) -> None:
        if w not in self.workers:
            return  # already replaced (a call and the watcher may both notice a death)
        log.info("replacing worker %s (tenant %s): %s", w.id, w.tenant_name, reason)
        self._drop(w, reason)
        self._ensure_spares()
        self._notify()

    def committed_bytes(self) -> int:
        """Device memory promised on all devices: per-context overhead plus bound caps."""
        return sum(d.committed_bytes for d in self.devices.devices)

    def _evict_one(self, exclude: str, cap: int = 0) -> bool:
        """Retire the least recently used idle worker of another tenant whose departure lets a
        context with `cap` start on its device (a slot, a context below the ceiling, budget)."""
        now = self.devices.clock()
        # at max_workers, any worker's slot serves if some device could place the cap but for the slot
        slot_helps = len(self._alive()) >= self.settings.max_workers and self.devices.place(cap) is not None

        def helps(w: WorkerHandle) -> bool:
            d = self.devices[w.device_index]
            if slot_helps:
                return True
            below_ceiling = not d.ceiling or d.contexts - 1 < d.ceiling
            fits = not d.budget_bytes or d.committed_bytes - w.gpu_cap + cap <= d.budget_bytes
            return now >= d.next_start_at and below_ceiling and fits

        idle = [w for w in self.workers if w.state == WorkerState.IDLE and w.tenant_id != exclude and helps(w)]
        if not idle:
            return False
        self._retire(min(idle, key=lambda w: w.last_used), "evicted")
        return True

    def _spare_for(self, cap: int) -> WorkerHandle | None:
        """A spare whose device's budget takes `cap`, on the device with the most budget left."""
        spares = [w for w in self.workers if w.state == WorkerState.SPARE and self.devices[w.device_index].fits(cap)]
        if not spares:
            return None
        return min(spares, key=lambda w: (-(self.devices[w.device_index].free_bytes() or 0), w.device_index))

    def _provide_spare(self, cap: int, exclude: str) -> _Progress:
        """Make a spare for `cap` come: start one, or evict an idle worker of another tenant."""
        starting = [w for w in self.workers if w.state == WorkerState.STARTING]
        if sum(1 for w in starting if self.devices[w.device_index].fits(cap)) >= self._binders:
            return _Progress.PENDING
        if self._start_slots() > 0:
            device = self.devices.place(cap)
            if device is not None:
                self._spawn(device)
                return _Progress.PENDING
        # Every slot taken: make room for one more start while fewer are under way than calls
        # wait and the parallel-start bound allows, so the driver always has the next context
        # to create (starts one after another would leave it idle between them).
        if len(starting) < self.settings.max_parallel_starts and self._evict_one(exclude, cap):
            return _Progress.AGAIN
        return _Progress.PENDING if starting else _Progress.NONE

    async def _acquire_worker(self, ts: _Tenant, deadline: float) -> WorkerHandle:
        """A worker bound to the tenant by `deadline` (the call's queue wait), or NoCapacity."""
        cap = ts.principal.quota.gpu_memory_bytes
        if not self.devices.could_ever_fit(cap):
            raise NoCapacity(f"the tenant's GPU cap ({cap} bytes) does not fit any device of this node")
        stuck_until: float | None = None  # nothing under way for this call: wait at most the queue wait
        t_acquire = time.perf_counter()
        self._binders += 1  # calls waiting for a worker that none of theirs can serve
        waiting = True
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
                    spare = self._spare_for(cap)
                    if spare is not None:
                        spare.state = WorkerState.BINDING
                        device = self.devices[spare.device_index]
                        self.devices.bound(device, cap)  # now: other calls place while this one binds
                        self._binders -= 1  # has its worker: no start is needed for it
                        waiting = False
                        try:
                            await spare.bind(ts.principal.id, ts.principal.name, cap, self.secret)
                        except WorkerLost:
                            self.devices.bound(device, -cap)  # not bound: it leaves as a spare would
                            self._retire(spare, "crashed")
                            self._binders += 1
                            waiting = True
                            continue
                        except BaseException:  # cancelled mid-bind: its reply would be orphaned
                            self.devices.bound(device, -cap)
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
                    progress = self._provide_spare(cap, exclude=ts.principal.id)
                    if progress == _Progress.AGAIN:  # room made: its replacement may start now
                        stuck_until = None
                        continue
                    if progress == _Progress.PENDING:
                        stuck_until = None
                    elif stuck_until is None:
                        stuck_until = time.monotonic() + self.settings.queue_wait_ms / 1000
                    if self.on_worker_wait is not None:
                        self.on_worker_wait()
                    if stuck_until is None:
                        await self._wait_change(deadline)
                    else:
                        await self._wait_change(
                            min(deadline, stuck_until),
                            "every device of this node is at its context ceiling or memory budget, or backing off "
                            "after failed starts, and no idle worker could be evicted",
                        )
        finally:
            if waiting:
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

    def _wake(self, granted: list[Ticket]) -> None:
        for ticket in granted:
            if isinstance(ticket.waker, Waiting):
                self._slot_granted(ticket.waker)

    def _check_queue(self, ts: _Tenant) -> None:
        limit = ts.principal.quota.max_concurrency
        if len(self.fair.queue(ts.principal.id)) >= self.settings.queue_limit:
            self.rejections[(ts.principal.name, "queue_full")] += 1
            raise Rejected(RejectReason.QUEUE_FULL, f"tenant is at its concurrency limit ({limit}) and its queue is full", 1)

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
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Lease] = loop.create_future()

        def granted(lease: Lease) -> None:
            if fut.done():  # its caller went away as the lease came: back, unused
                loop.call_soon(self.release, lease, Outcome.UNUSED)
            else:
                fut.set_result(lease)

        def failed(exc: Exception) -> None:
            if not fut.done():
                fut.set_exception(exc)

        waiting = self.queue_lease(principal, granted, failed)
        try:
            return await fut
        except asyncio.CancelledError:
            self.withdraw(waiting)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result(), Outcome.UNUSED)  # granted, then cancelled before it resumed
            raise

    def lease_now(self, principal: TenantPrincipal, check_rate: bool = False) -> Lease | None:
        """The lease without waiting, when the tenant may start a call now and has an idle
        worker (a warm tenant's usual call): no task, no event-loop turn. None: call `lease`
        or `queue_lease` (with check_rate=False: the rate was taken here)."""
        ts = self._tenant(principal)
        if check_rate:
            self._take_rate(ts)
        if ts.waiters:
            return None  # FIFO: those queued go first
        w = self._idle_worker(ts)
        if w is None:
            return None
        ticket, granted = self.fair.submit(principal.id, principal.quota.max_concurrency)
        self._wake(granted)  # others' calls may take workers here: of their own tenants only
        if not ticket.granted or w.state != WorkerState.IDLE:
            self._wake(self.fair.withdraw(ticket))
            return None
        w.state = WorkerState.BUSY
        ts.last_used = time.monotonic()
        return self._grant(w, ts, ticket)

    @staticmethod
    def _idle_worker(ts: _Tenant) -> WorkerHandle | None:
        """The tenant's first idle worker bound with its current cap (another cap: `_acquire_worker`
        retires it)."""
        cap = ts.principal.quota.gpu_memory_bytes
        return next((w for w in ts.workers if w.state == WorkerState.IDLE and w.gpu_cap == cap), None)

    def queue_lease(self, principal: TenantPrincipal, granted: Callable[[Lease], None], failed: Callable[[Exception], None]) -> Waiting:
        """Queue a call `lease_now` could not serve. While it waits for its slot it holds a
        ticket and a timer, not a task: the release that frees the slot hands it the tenant's
        idle worker at once. Only a slot granted with no idle worker of the tenant (a bind, an
        eviction) goes on in a task. `granted` or `failed` (Rejected, NoCapacity) is called once,
        maybe before this returns; `withdraw` gives up a call whose caller went away. Raises
        Rejected (queue_full) at once."""
        ts = self._tenant(principal)
        self._check_queue(ts)
        wait_s = self.settings.queue_wait_ms / 1000
        ticket, others = self.fair.submit(principal.id, principal.quota.max_concurrency)
        waiting = ticket.waker = Waiting(ticket, ts, time.monotonic() + wait_s, granted, failed)
        if not ticket.granted:
            waiting.timer = asyncio.get_running_loop().call_later(wait_s, self._queue_timeout, waiting)
        self._wake(others)  # ours among them when its slot is free now
        return waiting

    def withdraw(self, waiting: Waiting) -> None:
        """Its caller went away: give back what it holds. A call already granted or failed is
        its holder's to release (or holds nothing)."""
        if not waiting.pending:
            return
        state, waiting.state = waiting.state, WaitState.WITHDRAWN
        if waiting.timer is not None:
            waiting.timer.cancel()
        if state == WaitState.QUEUED:
            self._wake(self.fair.withdraw(waiting.ticket))
        elif waiting.task is not None:
            waiting.task.cancel()  # its done callback gives the slot back, started or not

    def _slot_granted(self, waiting: Waiting) -> None:
        if waiting.state != WaitState.QUEUED:
            return
        if waiting.timer is not None:
            waiting.timer.cancel()
            waiting.timer = None
        ts = waiting.tenant
        w = self._idle_worker(ts)
        if w is not None:
            w.state = WorkerState.BUSY
            ts.last_used = time.monotonic()
            waiting.state = WaitState.GRANTED
            waiting.granted(self._grant(w, ts, waiting.ticket))
            return
        waiting.state = WaitState.BINDING
        waiting.task = task = asyncio.get_running_loop().create_task(self._worker_for(waiting))
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._bound, waiting))

    async def _worker_for(self, waiting: Waiting) -> None:
        w = await self._acquire_worker(waiting.tenant, waiting.deadline)
        if waiting.state != WaitState.BINDING:  # withdrawn as the worker came
            w.state = WorkerState.IDLE
            self._notify()
            raise asyncio.CancelledError
        waiting.tenant.last_used = time.monotonic()
        waiting.state = WaitState.GRANTED
        waiting.granted(self._grant(w, waiting.tenant, waiting.ticket))

    def _bound(self, waiting: Waiting, task: asyncio.Task[None]) -> None:
        """A bind's task ended: a call that got no lease gives its slot back."""
        self._tasks.discard(task)
        if waiting.state == WaitState.GRANTED:
            return
        self._leave(waiting.ticket)
        if waiting.state == WaitState.BINDING:
            waiting.state = WaitState.FAILED
            exc = NoCapacity("the node is stopping") if task.cancelled() else task.exception()
            if not isinstance(exc, (Rejected, NoCapacity)):
                log.error("finding a worker failed", exc_info=exc)
                exc = NoCapacity(f"finding a worker failed: {exc}")
            waiting.failed(exc)

    def _queue_timeout(self, waiting: Waiting) -> None:
        waiting.timer = None
        if waiting.state != WaitState.QUEUED:
            return
        ts = waiting.tenant
        blocked = self.fair.blocked(ts.principal.id)
        waiting.state = WaitState.FAILED
        self._wake(self.fair.withdraw(waiting.ticket))
        waiting.failed(self._refusal(ts, blocked))

    def _grant(self, w: WorkerHandle, ts: _Tenant, ticket: Ticket) -> Lease:
        # unique on this node is enough: a front proves its lease with the token, not the id
        return Lease(f"{self._node_tag}-{next(self._lease_seq):x}", w, ts, ticket, w.kernels_version)

    def contended(self, tenant_id: str) -> bool:
        """Another tenant's call waits for a worker slot (not for its own limits), or a call
        waits for a worker to be bound: what a lease of `tenant_id` kept busy may hold up."""
        return self._binders > 0 or self.fair.starved(tenant_id)

    def prepay(self, lease: Lease, runs: int) -> int:
        """Take up to `runs` more calls from the lease's tenant's rate now, for a lease a front
        keeps for further calls (app/node/supervisor.py); returns how many were taken. Only from
        the upper half of the tenant's burst: what other fronts' calls need is never paid ahead."""
        bucket = lease.tenant.bucket
        return bucket.take_up_to(runs, keep=bucket.capacity / 2)

    def release(self, lease: Lease, outcome: Outcome, kernels_version: str = "", runs: int = 1, unused: int = 0) -> None:
        """Give the worker back: idle again after a clean call, replaced after anything else.
        `runs`: the calls the lease carried; `unused`: calls paid for by `prepay` and not made."""
        if lease.released:
            return
        lease.released = True
        w = lease.worker
        if unused > 0:
            lease.tenant.bucket.give_back(unused)
        try:
            if outcome in (Outcome.OK, Outcome.DEVICE_ERROR):
                w.kernels_version = kernels_version
                w.invocations += runs
                w.last_used = time.monotonic()
            clean = outcome in (Outcome.OK, Outcome.UNUSED)
            if clean and w.proc is not None and w.proc.returncode is not None:
                self._retire(w, "exited")  # died while leased with no call on it (a held lease)
            elif clean and not w.retire_reason and w.state == WorkerState.BUSY:
                w.state = WorkerState.IDLE
                self._notify()
            elif clean:
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
                device_name=w.device.name,
                device=w.device_index,
            )
            for w in self.workers
        ]

    def queue_depth(self) -> int:
        return self.fair.queued()

    def waiting(self) -> int:
        """Calls waiting anywhere: for a slot (queued) or, holding one, for a worker."""
        return self.fair.queued() + self._binders

    def device_views(self) -> list[dict[str, Any]]:
        """Per device: status, contexts, ceiling, memory and starts (for /readyz and metrics)."""
        return self.devices.view()

    def readiness(self) -> Readiness:
        return Readiness(
            workers=self.ready(),
            devices_usable=self.devices.usable(),
            devices=[msgspec.convert(d, DeviceView) for d in self.device_views()],
        )
