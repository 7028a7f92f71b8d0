"""The node's worker processes (their device contexts): spawned, started, watched, kept as spares,
evicted, drained and retired. Which tenant a worker serves and which call gets it is the
scheduler's (app/scheduler/scheduler.py); this module runs the processes and tells the scheduler
through `Hooks` when something changed, never importing it.

Devices (app/scheduler/devices.py decides, this module acts): every GPU of the node is used, each
worker pinned to one through its own CUDA_VISIBLE_DEVICES. At least `warm_spares` spares are kept
per device, so the device a new tenant is placed on (the most free budget below its ceiling) has a
spare ready, and a node with more GPUs keeps more ready; a share of the slots no tenant holds
(`spare_room_share`) and, while new tenants arrive, up to
`max_warm_spares` per device, as many as arrive within one measured start
(app/scheduler/spares.py), within the free slots; at most `max_parallel_starts` workers
start at once (the driver serialises context creation anyway); a failed start backs its device
off exponentially, and a context the driver refuses sets that device's ceiling: no start loop.
When every worker slot is bound, the least recently used workers of tenants idle past
`retire_idle_after_s` are retired in the background, several at once, so spares are ready before
the next new tenants arrive.

When no worker is free for a waiting call, the least recently used idle worker of another tenant
is evicted (killed and replaced, never handed over). A worker that dies, overruns the hard
deadline or reports a device error is killed and replaced; a drained worker takes no new calls and
is retired once what fronts queued at it is done.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from app.gpu.share import ShareTable
from app.node.admission import AdmissionTable
from app.scheduler.devices import Device, Inventory
from app.scheduler.spares import ArrivalRate, StartTimes, room_spares, spare_target, surge_rate
from app.settings import Settings
from app.worker.forkserver import ForkServer
from app.worker.handle import StartRefused, WorkerHandle, WorkerState

log = logging.getLogger(__name__)

# Builds the handle of a worker pinned to a device, not yet started (tests: one with no process).
WorkerFactory = Callable[[Device], WorkerHandle]


_ON_ITS_WAY = frozenset({WorkerState.STARTING, WorkerState.SPARE, WorkerState.BINDING})


class Progress(Enum):
    """What getting a spare for a waiting call has under way."""

    PENDING = 1  # a start that may serve it: wait for a change
    AGAIN = 2  # room was made just now: look again at once
    NONE = 3  # nothing: every device at its ceiling, budget or back-off, nothing idle to evict


def _nothing(*_: Any) -> None:
    return None


@dataclass
class Hooks:
    """What the pool tells or asks the scheduler that binds its workers to tenants. The defaults
    stand for a node with no tenants (a pool driven on its own)."""

    notify: Callable[[], None] = _nothing  # a worker came, went or freed up: waiting calls look again
    routes_changed: Callable[[str | None], None] = _nothing  # a tenant's routed workers changed
    unbind: Callable[[WorkerHandle], None] = _nothing  # a worker is gone: out of its tenant's list
    quiet: Callable[[str], bool] = lambda _: True  # the tenant has nothing running or queued
    give_up_worker: Callable[[str], bool] = lambda _: False  # a tenant but this one drains a worker


class WorkerPool:
    def __init__(
        self, settings: Settings, devices: Inventory, *, run_dir: Path | None = None, factory: WorkerFactory | None = None,
        hooks: Hooks | None = None,
    ) -> None:
        """`run_dir`: in a node of several fronts, where workers listen for fronts' runs.
        `factory`: the workers' handles (default: real processes, through the fork server when
        `settings.fork_server`)."""
        self.settings = settings
        self.devices = devices
        self.run_dir = run_dir
        self.hooks = hooks or Hooks()
        self.fork_server = ForkServer(settings.backend) if settings.fork_server and factory is None else None
        self._factory = factory or self._real_worker
        self.workers: list[WorkerHandle] = []
        self.restarts: Counter[str] = Counter()
        self.backend = "unknown"
        self.on_start: Callable[[float], None] | None = None  # observes a worker's start, fork to ready
        # a node of several fronts: their shared admission table (each worker's queue)
        self.table: AdmissionTable | None = None
        self._slots = itertools.count()
        self.start_times = StartTimes()  # what a call waiting for a start can expect
        self.arrivals = ArrivalRate()  # new tenants per second: spares are kept ahead of them
        # by worker id, while it starts: when it began (monotonic), and the starts under way then
        self._under_way: dict[str, tuple[float, int]] = {}
        # calls waiting for a worker (the scheduler counts them): spares leave room for their caps,
        # and no more starts are made for them than they need
        self.waiting_caps: Counter[int] = Counter()
        self.binders = 0  # calls waiting for a worker that none of theirs can serve
        self._evicted: dict[str, float] = {}  # tenant id -> when a worker of its, in use, was last evicted
        # each GPU worker's row in the node's GPU share table, and the GPU time of workers gone
        self.share: ShareTable | None = None
        self.gpu_seconds: dict[tuple[str, int], float] = {}  # (tenant name, device): of workers gone
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def _real_worker(self, device: Device) -> WorkerHandle:
        return WorkerHandle(self.settings, spawner=self.fork_server, device_index=device.index, visible_device=device.visible_id)

    async def stop(self) -> None:
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*(w.close() for w in self.workers), return_exceptions=True)
        self.workers.clear()
        if self.fork_server is not None:
            self.fork_server.close_sync()
        if self.share is not None:
            self.share.close(unlink=True)
            self.share = None

    def _background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- what fronts send straight to workers -----------------------------------------------------
    def busy(self, w: WorkerHandle) -> bool:
        """Calls queued at it or running on it that fronts sent without a lease."""
        return self.table is not None and w.slot >= 0 and self.table.queued(w.slot) > 0

    def last_used(self, w: WorkerHandle) -> float:
        page = w.stats.get("last_used_ms") / 1000 if w.stats is not None and self.table is not None else 0.0
        return max(w.last_used, page)

    def drain(self, w: WorkerHandle, reason: str) -> None:
        """No new calls for it; retired once what fronts queued at it is done."""
        w.retire_reason = reason
        self.hooks.routes_changed(w.tenant_id)
        if w.state == WorkerState.IDLE and not self.busy(w):
            self.retire(w, reason)

    def draining(self) -> bool:
        return any(w.retire_reason and w.state == WorkerState.IDLE for w in self.workers)

    def retire_drained(self) -> None:
        for w in list(self.workers):
            if w.retire_reason and w.state == WorkerState.IDLE and not self.busy(w):
                self.retire(w, w.retire_reason)

    # -- counts -----------------------------------------------------------------------------------
    def alive(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.state != WorkerState.DEAD]

    def _starting(self) -> int:
        return sum(1 for w in self.workers if w.state == WorkerState.STARTING)

    def start_slots(self) -> int:
        """Workers that may start now: worker slots free, within the parallel-start bound."""
        room = self.settings.max_workers - len(self.alive())
        return max(0, min(room, self.settings.max_parallel_starts - self._starting()))

    # -- spares -----------------------------------------------------------------------------------
    def spare_target(self, room: bool = True) -> int:
        """Spares to keep per device now: `warm_spares`, more while the node has room (`room`:
        counted) or new tenants arrive."""
        s = self.settings
        share = self.room_share() if room else 0
        return spare_target(self.arrivals.rate(), self.start_times.typical(), len(self.devices), s.warm_spares, s.max_warm_spares, share)

    def slots(self) -> int:
        """Workers the node may hold: `max_workers` or, if fewer, the contexts its devices may hold."""
        slots = self.settings.max_workers
        if all(d.ceiling for d in self.devices.devices):
            slots = min(slots, sum(d.ceiling for d in self.devices.devices))
        return slots

    def room_share(self) -> int:
        """Spares per device from the node's room: `spare_room_share` of the slots no tenant holds."""
        held = sum(1 for w in self.alive() if w.tenant_id is not None)
        return room_spares(self.slots() - held, len(self.devices), self.settings.spare_room_share)

    def crowded(self, cap: int, homeless: int | None) -> bool:
        """More tenants want a worker (those holding one, and `homeless` waiting for their first;
        None: unknown) than the node has slots, or the devices (a ceiling, a memory budget), not
        the slots, stand in the way of a context with `cap`: only then does one tenant's only
        worker in use make way for another's, a turn each. Otherwise a tenant without one waits
        for a worker on its way (a start, a spare being bound, a drained one's slot) or for a
        tenant holding several to give one up: taking an only worker would just move the wait
        to its tenant."""
        if homeless is None or self.devices.place(cap) is None:
            return True
        holding = {w.tenant_id for w in self.alive() if w.tenant_id is not None and not w.retire_reason}
        return len(holding) + homeless > self.slots()

    def spares_short(self) -> None:
        """A new tenant found no spare ready: keep twice as many ahead of arrivals (within
        `max_warm_spares`) while they last, and start them now. The arrivals' part alone is
        doubled: the room's share is no measure of them."""
        typical = self.start_times.typical()
        if typical and self.settings.warm_spares > 0:
            self.arrivals.at_least(surge_rate(self.spare_target(room=False), typical, len(self.devices)))
        self.ensure_spares()

    def any_spare(self) -> bool:
        return any(w.state == WorkerState.SPARE for w in self.workers)

    def _may_keep_spare(self, d: Device, have: int) -> bool:
        """Below `warm_spares` a spare starts wherever a context may; one kept for the room's
        share or for arrivals to come also leaves room for the largest cap a call waits with now,
        and for a new tenant's default cap (spares must not take the budget a tenant needs:
        `spare_gives_way`)."""
        if have < self.settings.warm_spares:
            return self.devices.can_start(d)
        cap = max(max(self.waiting_caps, default=0), self.settings.default_gpu_memory_bytes)
        return self.devices.can_start(d, self.devices.overhead + cap)

    def ensure_spares(self) -> None:
        """`spare_target` spare or starting workers on each device that may start one."""
        if self._closed:
            return
        have = Counter(w.device_index for w in self.alive() if w.state in (WorkerState.SPARE, WorkerState.STARTING))
        target = self.spare_target()
        slots = self.start_slots()
        while slots > 0:
            short = [d for d in self.devices.devices if have[d.index] < target and self._may_keep_spare(d, have[d.index])]
            if not short:
                break
            d = min(short, key=lambda d: (have[d.index], -(d.free_bytes() or 0), d.index))
            self.spawn(d)
            have[d.index] += 1
            slots -= 1
        self._free_slot_ahead()

    def trim_spares(self) -> None:
        """Spares past the target (new tenants stopped arriving, or tenants took the room) that
        have waited longer than `retire_idle_after_s` are retired, the oldest first: an idle node
        goes back to its room's share (at least `warm_spares`) per device."""
        target = self.spare_target()
        quiet_since = time.monotonic() - self.settings.retire_idle_after_s
        trimmed = False
        for d in self.devices.devices:
            spares = sorted((w for w in self.workers if w.state == WorkerState.SPARE and w.device_index == d.index), key=lambda w: w.last_used)
            for w in spares[: max(0, len(spares) - target)]:
                if w.last_used <= quiet_since:
                    log.info("retiring spare %s on device %d: more spares than new tenants need", w.id, d.index)
                    self.drop(w, "surplus_spare")
                    trimmed = True
        if trimmed:
            self.hooks.notify()

    def spare_gives_way(self, cap: int) -> bool:
        """No spare fits `cap` and no context for it may start: retire one of the spares kept for
        arrivals to come on a device where fewer spares would let the cap fit."""
        overhead = self.devices.overhead
        for d in self.devices.devices:
            spares = [w for w in self.workers if w.state == WorkerState.SPARE and w.device_index == d.index]
            keep = max(1, self.settings.warm_spares)  # those kept anyway would only start again
            if len(spares) > keep and d.budget_bytes and d.committed_bytes - (len(spares) - keep) * overhead + cap <= d.budget_bytes:
                self.retire(max(spares, key=lambda w: w.last_used), "surplus_spare")
                return True
        return False

    def _free_slot_ahead(self) -> None:
        """Every slot bound (the node's workers, or every device at its ceiling or budget) and
        fewer spares on the way than `warm_spares` per device: retire the least recently used
        workers of tenants with nothing running or queued (idle past `retire_idle_after_s`), so
        that the next new tenants find spares (their replacements). Several at once: the driver
        creates contexts one after another, and a pipeline of starts keeps it busy."""
        alive = self.alive()
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
            if w.state == WorkerState.IDLE and w.tenant_id is not None and self.last_used(w) <= quiet_since
            and self.hooks.quiet(w.tenant_id) and not self.busy(w)
        ]
        for w in sorted(idle, key=self.last_used)[:want]:
            self.retire(w, "evicted")

    def spare_for(self, cap: int) -> WorkerHandle | None:
        """A spare whose device's budget takes `cap`, on the device with the most budget left."""
        spares = [w for w in self.workers if w.state == WorkerState.SPARE and self.devices[w.device_index].fits(cap)]
        if not spares:
            return None
        return min(spares, key=lambda w: (-(self.devices[w.device_index].free_bytes() or 0), w.device_index))

    def provide_spare(self, cap: int, exclude: str, homeless: int | None = None) -> Progress:
        """Make a spare for `cap` come: start one, or evict an idle worker of another tenant.
        `homeless`: the tenants waiting for their first worker (None: as many as wait); starts
        are made room for, by eviction, for no more than that many at once."""
        starting = [w for w in self.workers if w.state == WorkerState.STARTING]
        if sum(1 for w in starting if self.devices[w.device_index].fits(cap)) >= self.binders:
            return Progress.PENDING
        if self.start_slots() > 0:
            device = self.devices.place(cap)
            if device is not None:
                self.spawn(device)
                return Progress.PENDING
        # A spare kept ahead of need whose budget the cap needs gives way before any tenant's
        # worker does.
        if self.spare_gives_way(cap):
            return Progress.AGAIN
        # Every slot taken: make room for one more start while fewer are under way than tenants
        # wait for their first worker and the parallel-start bound allows, so the driver always
        # has the next context to create (starts one after another would leave it idle between
        # them); a tenant's several calls, or a tenant that holds a worker, make room for none
        # (each eviction would leave another tenant to make room in turn).
        room_for = self.settings.max_parallel_starts if homeless is None else min(homeless, self.settings.max_parallel_starts)
        # A node with a slot for every tenant that wants one, and a worker on its way, has a
        # tenant about to hold two (a spare being bound as another's second) or a start or a
        # slot coming: it waits for that rather than take a tenant's only worker in use.
        coming = any(
            w.state in _ON_ITS_WAY and (w.state != WorkerState.SPARE or self.devices[w.device_index].fits(cap)) or w.retire_reason
            for w in self.alive()
        )
        if len(starting) < room_for and self.evict_one(exclude, cap, not coming or self.crowded(cap, homeless)):
            return Progress.AGAIN
        if coming:
            return Progress.PENDING
        if self.hooks.give_up_worker(exclude) or self.rotate_one(exclude, cap):
            return Progress.PENDING
        return Progress.NONE

    def start_eta(self, cap: int) -> float | None:
        """When the soonest start that could serve a call with `cap` should be ready: one under
        way, one start's time after it began for it and for each start it queued behind (or
        after now, for it and each still under way that began before it, if sooner); or one
        begun now, behind every start under way. None before any start was measured."""
        alone = self.start_times.alone()
        if alone is None:
            return None
        now = time.monotonic()
        began = sorted(
            ((u, w) for w in self.workers if w.state == WorkerState.STARTING and (u := self._under_way.get(w.id)) is not None),
            key=lambda uw: uw[0][0],
        )
        ready = [
            min(t + alone * (ahead + 1), now + alone * (before + 1))
            for before, ((t, ahead), w) in enumerate(began) if self.devices[w.device_index].fits(cap)
        ]
        return max(now, min(ready)) if ready else now + alone * (len(began) + 1)

    # -- eviction ---------------------------------------------------------------------------------
    def _makes_room(self, cap: int) -> Callable[[WorkerHandle], bool]:
        """Whether a worker's departure lets a context with `cap` start on its device (a slot, a
        context below the ceiling, budget)."""
        now = self.devices.clock()
        # at max_workers, any worker's slot serves if some device could place the cap but for the slot
        slot_helps = len(self.alive()) >= self.settings.max_workers and self.devices.place(cap) is not None

        def helps(w: WorkerHandle) -> bool:
            d = self.devices[w.device_index]
            if slot_helps:
                return True
            below_ceiling = not d.ceiling or d.contexts - 1 < d.ceiling
            fits = not d.budget_bytes or d.committed_bytes - w.gpu_cap + cap <= d.budget_bytes
            return now >= d.next_start_at and below_ceiling and fits

        return helps

    def evict_one(self, exclude: str, cap: int = 0, crowded: bool = True) -> bool:
        """Retire an idle worker of another tenant whose departure makes room for a context with
        `cap`: the least recently used of those unused for `retire_idle_after_s`, else one of the
        tenant in use that holds the most workers (max-min: between two calls a worker in steady
        use looks idle, and the tenant with the most gives one up first), its least recently
        used. A tenant's only worker in use goes only when the node is `crowded`; and then not
        to a tenant that lost one in use within `retire_idle_after_s` while a start is under
        way: the loser would want one back at its next call and do the same, round the node; it
        waits for the start instead."""
        helps = self._makes_room(cap)
        idle = [w for w in self.workers if w.state == WorkerState.IDLE and w.tenant_id != exclude and helps(w) and not self.busy(w)]
        if not idle:
            return False
        held: Counter[str | None] = Counter(w.tenant_id for w in self.alive() if w.tenant_id is not None and not w.retire_reason)
        now = time.monotonic()
        in_use_since = now - self.settings.retire_idle_after_s

        def order(w: WorkerHandle) -> tuple[bool, int, float]:
            used = self.last_used(w)
            in_use = used > in_use_since
            return in_use, -held[w.tenant_id] if in_use else 0, used

        if not crowded:
            idle = [w for w in idle if held[w.tenant_id] > 1 or not order(w)[0]]
            if not idle:
                return False
        w = min(idle, key=order)
        if order(w)[0] and w.tenant_id is not None:
            evicted_lately = exclude in self._evicted and self._evicted[exclude] > in_use_since  # (a monotonic clock may be young)
            if held[w.tenant_id] == 1 and evicted_lately and any(x.state == WorkerState.STARTING for x in self.workers):
                return False  # it waits for the start under way instead of passing its loss on
            if len(self._evicted) > 4 * max(1, self.settings.max_workers):
                self._evicted = {t: at for t, at in self._evicted.items() if at > in_use_since}
            self._evicted[w.tenant_id] = now
        self.retire(w, "evicted")
        return True

    def rotate_one(self, exclude: str, cap: int = 0) -> bool:
        """A tenant that holds no worker waits while every worker that could make room serves
        another tenant, each holding one: the call can still be served once one of them lets go,
        so it waits within its deadline rather than being refused. Under steady calls a busy
        worker never turns idle (its tenant's next call takes it at once), so the one bound
        longest ago is drained: no new calls, retired once what it runs or has queued is done,
        a turn each. A tenant that holds a worker waits for its own."""
        if any(w.tenant_id == exclude and w.state != WorkerState.DEAD for w in self.workers):
            return False
        helps = self._makes_room(cap)
        serving = [
            w for w in self.workers
            if w.state in (WorkerState.IDLE, WorkerState.BUSY) and w.tenant_id not in (None, exclude) and not w.retire_reason and helps(w)
        ]
        if not serving:
            return False
        self.drain(min(serving, key=lambda w: w.bound_at), "rotated")
        return True

    # -- a worker's life --------------------------------------------------------------------------
    def spawn(self, device: Device) -> WorkerHandle:
        w = self._factory(device)
        if self.run_dir is not None:
            w.socket_path = str(self.run_dir / f"w-{w.id}.sock")
        if self.table is not None:
            # slots go round the table, so a slot comes back long after its worker is gone
            used = {x.slot for x in self.workers}
            w.slot = next(i for i in (next(self._slots) % self.table.layout.workers for _ in range(self.table.layout.workers + 1)) if i not in used)
            self.table.clear_worker(w.slot)
        if self.share is not None:
            used = {x.share_row for x in self.workers}
            w.share_row = next((r for r in range(self.share.rows) if r not in used), -1)
            if w.share_row >= 0:
                self.share.clear(w.share_row)
        self.workers.append(w)
        self.devices.context_started(device)
        self._background(self._start_worker(w))
        return w

    async def _start_worker(self, w: WorkerHandle) -> None:
        device = self.devices[w.device_index]
        t0 = time.perf_counter()
        ahead = sum(1 for x in self.workers if x.state == WorkerState.STARTING and x.id in self._under_way)
        self._under_way[w.id] = (time.monotonic(), ahead)
        try:
            await w.start()
            self.start_times.add(time.perf_counter() - t0, ahead)
            if self.on_start is not None:
                self.on_start(time.perf_counter() - t0)
            self.devices.start_ok(device)
            self._background(self._watch(w))
            if self.backend == "unknown":  # every worker of a node runs the same backend
                self.backend = w.backend
        except StartRefused as exc:
            self.drop(w, "start_refused")  # first: the ceiling is what the device holds without it
            delay = self.devices.learn_refusal(device)
            log.warning("device %d refused a context (%s); its ceiling is now %d", device.index, exc, device.ceiling)
            if delay:
                self._after(delay)
        except Exception as exc:
            log.error("worker %s failed to start on device %d: %s", w.id, device.index, exc)
            self.drop(w, "start_failed")
            self._after(self.devices.start_failed(device))
        finally:
            self._under_way.pop(w.id, None)
            self.hooks.notify()
        self.ensure_spares()  # a start slot is free

    def _after(self, delay: float) -> None:
        """Look again once a device's back-off has run out (waiting calls too)."""
        def again() -> None:
            self.ensure_spares()
            self.hooks.notify()

        asyncio.get_running_loop().call_later(delay + 0.01, again)

    async def _watch(self, w: WorkerHandle) -> None:
        assert w.proc is not None
        await w.proc.wait()
        if w.state not in (WorkerState.DEAD, WorkerState.BUSY):  # a busy worker's death is handled by its call
            self.retire(w, "exited")

    def drop(self, w: WorkerHandle, reason: str) -> None:
        """Kill it and give back what it held (its slot, context, share row), counting why."""
        w.kill()
        if self.share is not None and w.share_row >= 0 and w in self.workers:
            if w.tenant_name:
                key = (w.tenant_name, w.device_index)
                self.gpu_seconds[key] = self.gpu_seconds.get(key, 0.0) + self.share.total(w.share_row)
            self.share.clear(w.share_row)
        if w in self.workers:
            self.workers.remove(w)
            self.devices.context_ended(self.devices[w.device_index], w.gpu_cap if w.tenant_id else 0)
        self.hooks.unbind(w)
        self.restarts[reason] += 1
        self._background(w.close())

    def retire(self, w: WorkerHandle, reason: str) -> None:
        """Drop it and start its replacement."""
        if w not in self.workers:
            return  # already replaced (a call and the watcher may both notice a death)
        log.info("replacing worker %s (tenant %s): %s", w.id, w.tenant_name, reason)
        self.drop(w, reason)
        self.ensure_spares()
        self.hooks.notify()
