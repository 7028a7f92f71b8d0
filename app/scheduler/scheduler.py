"""Binds tenants to worker processes (their device contexts) on one node.

Rules (docs/architecture.md, "Spares and churn"): a tenant's first call binds a warm spare; the binding stays while
the tenant is active; a tenant gets more workers as its concurrency needs, up to its
`max_concurrency` and its fair share of the node; when no worker is free the least recently
used idle worker of another tenant is evicted; a GPU binding is admitted only while the bound caps
plus per-context overhead fit its device. A worker that dies, overruns the hard deadline or
reports a device error is replaced; only its own call fails. The processes themselves (spawn,
start, spares, eviction, retirement, device bookkeeping) are app/scheduler/pool.py's.

The queue wait bounds a call's wait for a slot of its tenant; a call that then needs a worker
start waits for it as long as its tenant's timeout (from its arrival) allows, and is refused
(NoCapacity) at once when the measured start time cannot fit that, or after the queue wait when
nothing can start for it (every device at its ceiling, budget or back-off, nothing idle to evict).

A call holds a `Lease` from `lease` to `release`; the caller (a front, or the one-process api)
exchanges the call's bytes with the worker itself. In a node of several fronts, a tenant's warm
calls do not come here at all: fronts send them straight to its bound workers (`routes`, pushed
through `on_routes`), counting each worker's queue in the node's admission table, which the pool
reads before it retires a worker that looks idle. A front asks for one more worker
(`grow`) when the tenant's calls queue at every one of its workers; a tenant that holds more than
one worker gives one up (drained: no new calls, retired once its queue is empty) when another
tenant waits for a worker and nothing idle is left.

Which call gets the node's next worker slot (per-tenant concurrency, the fair share of workers,
FIFO within a tenant) is decided by app/scheduler/fairness.py; this module admits the calls and
binds the pool's workers to them.
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
from pathlib import Path
from typing import Any

import msgspec

from app.contract.errors import HardTimeout, NoCapacity, Rejected, RejectReason, WorkerCrashed
from app.contract.messages import DeviceView, Outcome, Principal, Readiness, Usage, WorkerInfo
from app.gpu.probe import probe
from app.gpu.share import ShareTable
from app.gpu.share import sweep_tables as sweep_share_tables
from app.gpu.share import table_path as share_table_path
from app.scheduler.devices import Device, Inventory
from app.scheduler.fairness import Blocked, FairShare, Ticket
from app.scheduler.leases import KernelSet, Lease, Waiting, WaitState, outcome_of
from app.scheduler.pool import Hooks, Progress, WorkerFactory, WorkerPool
from app.scheduler.ratelimit import TokenBucket
from app.settings import Settings
from app.worker.handle import WorkerHandle, WorkerLost, WorkerState
from app.worker.stats import stats_dir, sweep_stale_pages

log = logging.getLogger(__name__)

__all__ = ["HardTimeout", "KernelSet", "Lease", "NoCapacity", "Rejected", "Scheduler", "WorkerCrashed", "outcome_of"]

MAINTENANCE_S = 0.5  # how often spares, back-offs and the slot kept ahead of need are looked at
DRAIN_POLL_S = 0.01  # how often a draining worker's queue is looked at


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


@dataclass(eq=False)
class _InLine:
    """A call waiting for a worker to bind, by the GPU cap it needs and its tenant."""

    cap: int
    tenant: str = ""


@dataclass
class _Tenant:
    principal: Principal
    bucket: TokenBucket
    fair: FairShare  # holds the tenant's running count and queue, node-wide
    workers: list[WorkerHandle] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)
    growing: bool = False  # a bind asked by a front's `grow` is under way
    binding: int = 0  # spares being bound to it now: workers on their way, not yet in `workers`
    warm: bool = False  # a worker of the tenant that has gone had used the backend's deferred set-up

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
        discover: Callable[[Settings], Awaitable[Inventory]] | None = None, factory: WorkerFactory | None = None,
    ) -> None:
        """`secret` and `run_dir`: in a node of several fronts, the lease-token key given to every
        worker at bind and the private directory where workers listen for fronts' runs. `devices`:
        the node's devices as given (tests); else found at start by `discover`. `factory`: the
        workers' handles (default: real processes)."""
        self.settings = settings
        self.secret = secret
        self.run_dir = run_dir
        self._lease_seq = itertools.count(1)
        self._node_tag = uuid.uuid4().hex[:8]
        self.tenants: dict[str, _Tenant] = {}
        self.rejections: Counter[tuple[str, str]] = Counter()  # (tenant, reason)
        self.on_bind: Callable[[float], None] | None = None  # observes cold-start binding time
        self._discover = None if devices is not None else (discover or discover_devices)
        self.fair = FairShare(settings.max_workers, settings.reserved_workers)
        self._changed = asyncio.Event()
        # calls waiting for a worker to bind, in arrival order: a spare goes to the first of them
        # it fits, so under churn no call waits out its deadline while later ones are served
        self._line: list[_InLine] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        # who hears of a tenant's routed workers changing (a node of several fronts)
        self.on_routes: Callable[[str], None] | None = None
        self.pool = WorkerPool(
            settings, devices or Inventory.cpu(settings.context_overhead_bytes, settings.max_contexts_per_device),
            run_dir=run_dir, factory=factory,
            hooks=Hooks(
                notify=self._notify, routes_changed=self._routes_changed, unbind=self._unbind, quiet=self._quiet,
                give_up_worker=self._drain_one,
            ),
        )

    # -- the pool's state, under the names the node, metrics and tests use -------------------------
    @property
    def workers(self) -> list[WorkerHandle]:
        return self.pool.workers

    @property
    def restarts(self) -> Counter[str]:
        return self.pool.restarts

    @property
    def devices(self) -> Inventory:
        return self.pool.devices

    @devices.setter
    def devices(self, devices: Inventory) -> None:
        self.pool.devices = devices

    @property
    def share(self) -> ShareTable | None:
        return self.pool.share

    @share.setter
    def share(self, share: ShareTable | None) -> None:
        self.pool.share = share

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self, wait: bool = True) -> None:
        sweep_stale_pages(stats_dir(self.settings.data_dir))  # left by a node that crashed
        if self._discover is not None:
            self.devices = await self._discover(self.settings)
            self._discover = None
            log.info("devices: %s", ", ".join(f"{d.index} {d.name} ({d.budget_bytes >> 20} MiB)" for d in self.devices.devices))
        if self.settings.gpu_share and self.share is None and any(d.visible_id is not None for d in self.devices.devices):
            # GPU time by tenant weight: a row for each worker the node may hold at once
            where = self.run_dir or self.settings.data_dir
            sweep_share_tables(where)  # a node killed before it could remove its own
            self.share = ShareTable.create(
                share_table_path(where), rows=4 * self.settings.max_workers + 64,
                linger_s=self.settings.gpu_share_linger_ms / 1000,
            )
        self._background(self._maintain())
        self.pool.ensure_spares()
        if wait and self.settings.warm_spares > 0:  # with no spares kept, nothing to wait for
            deadline = time.monotonic() + self.settings.worker_start_timeout_s
            while not any(w.state == WorkerState.SPARE for w in self.workers) and time.monotonic() < deadline:
                if not any(w.state == WorkerState.STARTING for w in self.workers):
                    self.pool.ensure_spares()
                await self._wait_change(deadline)

    async def stop(self) -> None:
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        await self.pool.stop()

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
        last = time.monotonic()
        while not self._closed:
            draining = self.pool.draining()
            await asyncio.sleep(DRAIN_POLL_S if draining else MAINTENANCE_S)
            if draining:
                self.pool.retire_drained()
            if time.monotonic() - last >= MAINTENANCE_S:
                last = time.monotonic()
                self.pool.trim_spares()
                self.pool.ensure_spares()
                self._kill_overdue()

    # -- what the pool asks of the tenants' side ------------------------------------------------
    def _unbind(self, w: WorkerHandle) -> None:
        for ts in self.tenants.values():
            if w in ts.workers:
                ts.warm = ts.warm or w.used_deferred()  # read before its page is closed
                ts.workers.remove(w)
                self._routes_changed(ts.principal.id)

    def _quiet(self, tenant_id: str) -> bool:
        return self.fair.running(tenant_id) == 0 and not self.fair.queue(tenant_id)

    # -- what fronts send straight to workers -----------------------------------------------------
    def routed(self, tenant_id: str) -> list[WorkerHandle]:
        """The tenant's workers that fronts may send calls to."""
        ts = self.tenants.get(tenant_id)
        if ts is None:
            return []
        return [w for w in ts.workers if w.state in (WorkerState.IDLE, WorkerState.BUSY) and not w.retire_reason and w.slot >= 0]

    def _routes_changed(self, tenant_id: str | None) -> None:
        if tenant_id is not None and self.on_routes is not None:
            self.on_routes(tenant_id)

    def _kill_overdue(self) -> None:
        """The backstop of the hard deadline for calls fronts send straight to workers (a front
        stopped mid-call times nothing): a worker running one call past its tenant's longest
        time limit and the grace is killed and replaced."""
        if self.pool.table is None:
            return
        now_ms = time.monotonic() * 1000
        grace_ms = self.settings.hard_timeout_grace_ms + MAINTENANCE_S * 1000
        for ts in list(self.tenants.values()):
            for w in list(ts.workers):
                if w.stats is None or w.state != WorkerState.IDLE or not w.stats.get("running"):
                    continue  # a leased call is held to its deadline by its lease
                if now_ms - w.stats.get("running_since_ms") > ts.principal.quota.timeout_ms + grace_ms:
                    log.warning("worker %s ran one call of %s past its hard deadline; killing it", w.id, ts.principal.name)
                    self.pool.retire(w, "hard_timeout")

    def worker_failed(self, worker_id: str, outcome: Outcome) -> None:
        """A front saw a worker fail a call it sent straight to it: replace it."""
        w = next((w for w in self.workers if w.id == worker_id), None)
        if w is not None and outcome in _RETIRE_REASON:
            self.pool.retire(w, _RETIRE_REASON[outcome])

    def grow(self, principal: Principal) -> None:
        """A front saw the tenant's calls queue at every one of its workers: bind one more if its
        concurrency and its fair share allow and a spare is ready (else one is started, and the
        front's next hint finds it)."""
        ts = self._tenant(principal)
        if ts.growing or len(self.routed(principal.id)) >= principal.quota.max_concurrency:
            return
        others_wait = any(t != principal.id and self.fair.queue(t) for t in list(self.tenants))
        if others_wait and len(ts.workers) >= self.fair.share:
            return
        cap = principal.quota.gpu_memory_bytes
        if self._spare_taken_in_line():
            return  # a call waiting for its first worker takes a ready spare first
        spare = self.pool.spare_for(cap)
        if spare is None:
            if self.pool.start_slots() > 0 and (device := self.devices.place(cap)) is not None:
                self.pool.spawn(device)
            return
        ts.growing = True
        task = asyncio.get_running_loop().create_task(self._bind_spare(ts, spare, time.perf_counter()))
        self._tasks.add(task)

        def done(t: asyncio.Task[bool]) -> None:
            self._tasks.discard(t)
            ts.growing = False
            if not t.cancelled() and t.exception() is None and t.result():
                spare.state = WorkerState.IDLE
                self._routes_changed(principal.id)
                self._notify()

        task.add_done_callback(done)

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

    def gpu_time(self) -> dict[tuple[str, int], float]:
        """GPU seconds charged to each tenant (by name) on each device, workers gone included."""
        out = dict(self.pool.gpu_seconds)
        if self.share is not None:
            for w in self.workers:
                if w.tenant_name and w.share_row >= 0:
                    key = (w.tenant_name, w.device_index)
                    out[key] = out.get(key, 0.0) + self.share.total(w.share_row)
        return out

    def committed_bytes(self) -> int:
        """Device memory promised on all devices: per-context overhead plus bound caps."""
        return sum(d.committed_bytes for d in self.devices.devices)

    def _drain_one(self, exclude: str) -> bool:
        """Nothing idle to evict for a tenant waiting for its first worker: the tenant holding the
        most workers (two at least) gives one up, the one with the shortest queue, once it empties."""
        if self.pool.table is None:
            return False
        holders = [ts for ts in self.tenants.values() if ts.principal.id != exclude and len(self.routed(ts.principal.id)) >= 2]
        if not holders:
            return False
        ts = max(holders, key=lambda ts: len(self.routed(ts.principal.id)))
        w = min(self.routed(ts.principal.id), key=lambda w: self.pool.table.queued(w.slot) if self.pool.table is not None else 0)
        self.pool.drain(w, "fair_share")
        return True

    async def _acquire_worker(self, ts: _Tenant, deadline: float) -> WorkerHandle:
        """A worker bound to the tenant by `deadline` (the call's own: its arrival plus its
        tenant's timeout), or NoCapacity: at once when the measured start time cannot fit
        before it, after the queue wait when nothing can be started for it."""
        cap = ts.principal.quota.gpu_memory_bytes
        if not self.devices.could_ever_fit(cap):
            raise NoCapacity(f"the tenant's GPU cap ({cap} bytes) does not fit any device of this node")
        stuck_until: float | None = None  # nothing under way for this call: wait at most the queue wait
        t_acquire = time.perf_counter()
        self.pool.binders += 1  # calls waiting for a worker that none of theirs can serve
        self.pool.waiting_caps[cap] += 1
        waiting = True
        place = _InLine(cap, ts.principal.id)
        self._line.append(place)
        if not ts.workers:
            self._notify()  # one more tenant without a worker: the first in line may make room for its start too
        short = False
        try:
            while True:
                for w in ts.workers:
                    if w.state == WorkerState.IDLE and not w.retire_reason:
                        if w.gpu_cap != cap:  # quota changed since the binding
                            self.pool.drain(w, "quota_changed")
                            break
                        w.state = WorkerState.BUSY
                        return w
                else:
                    if not self._first_in_line(place):
                        await self._wait_change(deadline)  # a call ahead of it takes the spare that is ready
                        continue
                    spare = self.pool.spare_for(cap)
                    if spare is not None:
                        self.pool.binders -= 1  # has its worker: no start is needed for it
                        waiting = False
                        self._line.remove(place)  # out of line while it binds: the next may take another
                        self._notify()
                        try:
                            bound = await self._bind_spare(ts, spare, t_acquire)
                        finally:
                            self._line.insert(0, place)  # first again if it must wait once more
                        if not bound:
                            self.pool.binders += 1
                            waiting = True
                            continue
                        spare.state = WorkerState.BUSY
                        if len(ts.workers) == 1:  # a new tenant on this node: spares are kept ahead of them
                            self.pool.arrivals.note()
                        self._routes_changed(ts.principal.id)
                        return spare
                    if not short and not ts.workers and not self.pool.any_spare():
                        short = True  # once a call: a new tenant found no spare ready (not: none that fits its cap)
                        self.pool.spares_short()
                    eta = self.pool.start_eta(cap)
                    if eta is not None and eta > deadline:
                        raise NoCapacity(
                            f"a worker start takes about {self.pool.start_times.alone():.2f} s on this node and the next "
                            f"that could serve this call would be ready in {eta - time.monotonic():.2f} s, "
                            "longer than this call may still wait (its tenant's timeout)"
                        )
                    progress = self.pool.provide_spare(cap, exclude=ts.principal.id, homeless=self._homeless(ts))
                    if progress == Progress.AGAIN:  # room made: its replacement may start now
                        stuck_until = None
                        continue
                    if progress == Progress.PENDING:
                        stuck_until = None
                    elif stuck_until is None:
                        stuck_until = time.monotonic() + self.settings.queue_wait_ms / 1000
                    if stuck_until is None:
                        await self._wait_change(deadline)
                    else:
                        await self._wait_change(
                            min(deadline, stuck_until),
                            "every device of this node is at its context ceiling or memory budget, or backing off "
                            "after failed starts, and no idle worker could be evicted",
                        )
        finally:
            self._line.remove(place)
            if self._line:
                self._notify()  # the next in line may take what this call left
            self.pool.waiting_caps[cap] -= 1
            if not self.pool.waiting_caps[cap]:
                del self.pool.waiting_caps[cap]
            if waiting:
                self.pool.binders -= 1

    def _homeless(self, ts: _Tenant) -> int:
        """Tenants whose calls wait for their first worker with none being bound to them, 0 when
        `ts` holds one or is being bound one: a tenant that holds workers waits for them (or
        grows into a spare) rather than evicting another's, and a spare binding is a worker
        already found (counting its tenant would make room for a start nobody needs)."""
        if ts.workers or ts.binding:
            return 0
        return len({p.tenant for p in self._line if (t := self.tenants.get(p.tenant)) is not None and not t.workers and not t.binding})

    def _first_in_line(self, place: _InLine) -> bool:
        """No call that came before this one could take a spare that is ready now."""
        return not self._spare_taken_in_line(before=place)

    def _spare_taken_in_line(self, before: _InLine | None = None) -> bool:
        """A call in line (ahead of `before`, if given) could take a spare that is ready now."""
        fits: dict[int, bool] = {}  # by cap: one look at the spares each, however long the line
        for ahead in self._line:
            if ahead is before:
                return False
            ready = fits.get(ahead.cap)
            if ready is None:
                ready = fits[ahead.cap] = self.pool.spare_for(ahead.cap) is not None
            if ready:
                return True
        return False

    async def _bind_spare(self, ts: _Tenant, spare: WorkerHandle, t_acquire: float) -> bool:
        """Bind a spare to the tenant; False when it died meanwhile (replaced)."""
        cap = ts.principal.quota.gpu_memory_bytes
        spare.state = WorkerState.BINDING
        device = self.devices[spare.device_index]
        self.devices.bound(device, cap)  # now: other calls place while this one binds
        ts.binding += 1
        try:
            share_path = str(self.share.path) if self.share is not None else ""
            warm = ts.warm or any(w.used_deferred() for w in ts.workers)
            await spare.bind(ts.principal.id, ts.principal.name, cap, self.secret, share_path, ts.principal.quota.gpu_weight, warm)
        except WorkerLost:
            self.devices.bound(device, -cap)  # not bound: it leaves as a spare would
            self.pool.retire(spare, "crashed")
            return False
        except BaseException:  # cancelled mid-bind: its reply would be orphaned
            self.devices.bound(device, -cap)
            self.pool.retire(spare, "cancelled")
            raise
        finally:
            ts.binding -= 1
        if self.on_bind is not None:
            self.on_bind(time.perf_counter() - t_acquire)  # waiting for a spare included
        # in use from now: a spare's `last_used` is its start, and a worker just bound whose first
        # call has not ended would read as unused for that long (the first to evict)
        spare.bound_at = spare.last_used = time.monotonic()
        ts.workers.append(spare)
        # Refill once this call has answered: spawning a process forks the api process, which
        # would otherwise land inside the cold call it serves.
        asyncio.get_running_loop().call_later(0.01, self.pool.ensure_spares)
        return True

    # -- per-tenant admission -------------------------------------------------------------------
    def _tenant(self, principal: Principal) -> _Tenant:
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

    def check_rate(self, principal: Principal) -> None:
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
        self._routes_changed(tenant_id)  # none now: its next call asks, under its new settings
        for w in list(ts.workers):
            if w.state == WorkerState.IDLE and not self.pool.busy(w):
                self.pool.retire(w, "tenant_changed")
            else:
                w.retire_reason = "tenant_changed"

    # -- the call: lease, exchange (by the caller), release ----------------------------------
    async def lease(self, principal: Principal, check_rate: bool = False) -> Lease:
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

    def lease_now(self, principal: Principal, check_rate: bool = False) -> Lease | None:
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

    def queue_lease(self, principal: Principal, granted: Callable[[Lease], None], failed: Callable[[Exception], None]) -> Waiting:
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
        now = time.monotonic()
        # a worker start may take the call's own time, never less than the queue wait
        start_by = now + max(wait_s, principal.quota.timeout_ms / 1000)
        waiting = ticket.waker = Waiting(ticket, ts, now + wait_s, granted, failed, start_deadline=start_by)
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
        w = await self._acquire_worker(waiting.tenant, waiting.start_deadline)
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

    def release(self, lease: Lease, outcome: Outcome, kernels_version: str = "") -> None:
        """Give the worker back: idle again after a clean call, replaced after anything else."""
        if lease.released:
            return
        lease.released = True
        w = lease.worker
        try:
            if outcome in (Outcome.OK, Outcome.DEVICE_ERROR):
                w.kernels_version = kernels_version
                w.invocations += 1
                w.last_used = time.monotonic()
            clean = outcome in (Outcome.OK, Outcome.UNUSED)
            if clean and w.proc is not None and w.proc.returncode is not None:
                self.pool.retire(w, "exited")  # died while leased with no call on it (an unused lease)
            elif clean and not w.retire_reason and w.state == WorkerState.BUSY:
                w.state = WorkerState.IDLE
                self._notify()
            elif clean:
                self.pool.retire(w, w.retire_reason or "exited")
            else:
                self.pool.retire(w, _RETIRE_REASON[outcome])
        finally:
            self._leave(lease.ticket)

    # -- views --------------------------------------------------------------------------------
    def usage(self, tenant_id: str) -> Usage:
        ts = self.tenants.get(tenant_id)
        if self.pool.table is not None:  # fronts count what they send straight to workers
            inflight = self.pool.table.inflight(tenant_id)
            workers = len(ts.workers) if ts is not None else 0
            return Usage(
                running=min(inflight, workers),
                queued=max(0, inflight - workers),
                workers=workers,
                gpu_bytes_in_use=sum(w.live_stats().get("gpu_bytes_in_use", 0) for w in ts.workers) if ts is not None else 0,
            )
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
                state=WorkerState.BUSY.value if w.state == WorkerState.IDLE and self.pool.busy(w) else w.state.value,
                backend=w.backend,
                tenant_id=w.tenant_id,
                tenant=w.tenant_name,
                gpu_bytes_in_use=w.live_stats().get("gpu_bytes_in_use", 0),
                gpu_bytes_cap=w.gpu_cap,
                invocations=max(w.invocations, w.live_stats().get("invocations", 0)),  # the worker counts fronts' direct calls
                started_at=w.started_at.isoformat(),
                compute_capability=w.device.compute_capability,
                device_name=w.device.name,
                device=w.device_index,
            )
            for w in self.workers
        ]

    def queue_depth(self) -> int:
        return self.fair.queued()

    def device_views(self) -> list[dict[str, Any]]:
        """Per device: status, contexts, ceiling, memory and starts (for /readyz and metrics)."""
        return self.devices.view()

    def readiness(self) -> Readiness:
        ready, usable = self.ready(), self.devices.usable()
        return Readiness(
            workers=ready,
            devices_usable=usable,
            devices=[msgspec.convert(d, DeviceView) for d in self.device_views()],
            # a node told to keep no spares has no worker until its first call, which starts one:
            # unready until then, a balancer that routes to ready nodes would never send that call
            on_demand=not ready and usable and self.settings.warm_spares <= 0,
        )
