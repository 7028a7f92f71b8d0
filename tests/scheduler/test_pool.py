"""The worker pool (app/scheduler/pool.py) on its own, with no scheduler and no processes: workers
come from a fake factory, the scheduler's side is a recording `Hooks`. Spares up to the target per
device, a dead worker replaced and counted, the device ceiling and max_workers, eviction, turns
when every slot serves."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from app.node.admission import AdmissionTable
from app.scheduler.devices import Device, Inventory
from app.scheduler.pool import Hooks, Progress, WorkerPool
from app.worker.handle import WorkerHandle, WorkerState
from tests.helpers import FakeStarts, fake_worker_factory, make_settings, until


class Recorded:
    """What the pool told the scheduler's side."""

    def __init__(self) -> None:
        self.notified = 0
        self.unbound: list[WorkerHandle] = []

    def hooks(self) -> Hooks:
        def notify() -> None:
            self.notified += 1

        return Hooks(notify=notify, unbind=self.unbound.append)


@asynccontextmanager
async def pool(tmp_path: Path, devices: Inventory, **overrides: Any) -> AsyncIterator[tuple[WorkerPool, FakeStarts, Recorded]]:
    settings = make_settings("sqlite://", tmp_path, fork_server=False, backend="cpu", **overrides)
    factory, starts = fake_worker_factory(settings)
    seen = Recorded()
    p = WorkerPool(settings, devices, factory=factory, hooks=seen.hooks())
    try:
        yield p, starts, seen
    finally:
        await p.stop()


def gpus(*devices: Device) -> Inventory:
    return Inventory(list(devices), 0)


def spares(p: WorkerPool) -> Counter[int]:
    return Counter(w.device_index for w in p.workers if w.state == WorkerState.SPARE)


async def filled(p: WorkerPool, n: int) -> None:
    """`n` spares started on the pool's one device and ready."""
    p.ensure_spares()
    await until(lambda: spares(p)[0] == n, f"{n} spares", 2)


def bind(w: WorkerHandle, tenant_id: str, last_used: float) -> None:
    """As the scheduler leaves a worker bound to a tenant between calls."""
    w.tenant_id, w.tenant_name, w.state, w.last_used = tenant_id, tenant_id, WorkerState.IDLE, last_used


async def test_spares_are_started_up_to_the_target_on_each_device(tmp_path: Path) -> None:
    async with pool(tmp_path, gpus(Device(0, "0"), Device(1, "1")), max_workers=10, warm_spares=2) as (p, starts, seen):
        assert p.spare_target() == 2
        p.ensure_spares()
        await until(lambda: spares(p) == Counter({0: 2, 1: 2}), "two spares on each device", 2)
        p.ensure_spares()  # at the target: nothing more starts
        assert starts.started == 4 and len(p.workers) == 4
        assert [p.devices[i].contexts for i in (0, 1)] == [2, 2]
        assert p.backend == "cpu" and seen.notified >= 4  # each start told the waiting calls


async def test_a_dead_worker_is_replaced_and_its_reason_counted(tmp_path: Path) -> None:
    async with pool(tmp_path, gpus(Device(0, "0")), max_workers=4, warm_spares=1) as (p, starts, seen):
        await filled(p, 1)
        dead = p.workers[0]
        assert dead.proc is not None
        dead.proc.kill()  # the process died: its watcher notices
        await until(lambda: p.restarts["exited"] == 1, "the death counted", 2)
        await until(lambda: spares(p)[0] == 1 and dead not in p.workers, "a replacement spare", 2)
        assert starts.started == 2 and seen.unbound == [dead] and p.devices[0].contexts == 1


async def test_a_failed_start_is_counted_and_backs_its_device_off(tmp_path: Path) -> None:
    async with pool(tmp_path, gpus(Device(0, "0")), max_workers=4, warm_spares=1) as (p, starts, _):
        starts.fail = True
        p.ensure_spares()
        await until(lambda: p.restarts["start_failed"] == 1, "the failed start counted", 2)
        assert not p.workers and p.devices[0].start_failures == 1 and not p.devices.usable()


async def test_starts_stay_within_the_device_ceiling_and_max_workers(tmp_path: Path) -> None:
    devices = gpus(Device(0, "0", configured_ceiling=2), Device(1, "1"))
    async with pool(tmp_path, devices, max_workers=5, warm_spares=8, max_parallel_starts=8) as (p, starts, _):
        p.ensure_spares()
        await until(lambda: sum(spares(p).values()) == 5, "the node's slots full of spares", 2)
        p.ensure_spares()
        assert starts.started == 5 and len(p.alive()) == 5 and p.start_slots() == 0  # max_workers
        assert p.devices[0].contexts == 2 and p.devices[1].contexts == 3  # device 0 at its ceiling


async def test_eviction_picks_the_least_recently_used_idle_worker_of_another_tenant(tmp_path: Path) -> None:
    async with pool(tmp_path, gpus(Device(0, "0")), max_workers=4, warm_spares=4) as (p, _, seen):
        await filled(p, 4)
        mine, old, older, busy = p.workers
        bind(mine, "a", last_used=1.0)  # the oldest, but of the tenant that asks
        bind(old, "b", last_used=3.0)
        bind(older, "c", last_used=2.0)
        bind(busy, "b", last_used=0.5)
        busy.state = WorkerState.BUSY  # running a call: never evicted
        p.settings.warm_spares = 0  # no replacement: only the choice is looked at
        assert p.evict_one(exclude="a")
        assert older not in p.workers and seen.unbound == [older] and p.restarts["evicted"] == 1
        assert p.evict_one(exclude="a") and old not in p.workers
        assert not p.evict_one(exclude="a")  # only the asking tenant's and a busy one are left
        assert p.workers == [mine, busy]


async def test_among_workers_in_use_the_tenant_holding_the_most_gives_one_up_first(tmp_path: Path) -> None:
    async with pool(tmp_path, gpus(Device(0, "0")), max_workers=4, warm_spares=4) as (p, _, _seen):
        await filled(p, 4)
        only, first, second, quiet = p.workers
        now = time.monotonic()
        bind(only, "c", last_used=now - 0.05)  # c's only worker, between two of its calls: the least recently used
        bind(first, "b", last_used=now - 0.01)
        bind(second, "b", last_used=now - 0.02)
        bind(quiet, "d", last_used=now - 60)  # unused past retire_idle_after_s: goes before any in use
        p.settings.warm_spares = 0
        assert p.evict_one(exclude="a") and quiet not in p.workers
        # b holds two: its least recently used goes, not c's only one
        assert p.evict_one(exclude="a") and second not in p.workers and only in p.workers
        # one each now: the least recently used takes its turn; but b, which just lost one in use,
        # waits for a start under way rather than take c's only one (c would do the same next)
        first.state = WorkerState.STARTING
        assert not p.evict_one(exclude="b") and only in p.workers
        first.state = WorkerState.IDLE
        assert p.evict_one(exclude="a") and only not in p.workers and p.workers == [first]


async def test_a_tenants_several_calls_make_room_for_one_start_and_a_tenant_with_a_worker_for_none(tmp_path: Path) -> None:
    async with pool(tmp_path, gpus(Device(0, "0")), max_workers=5, warm_spares=5, max_parallel_starts=6) as (p, starts, _):
        await filled(p, 5)
        now = time.monotonic()
        for w, tenant in zip(p.workers, "abcde", strict=True):
            bind(w, tenant, last_used=now)  # every slot serving a tenant in use
        p.workers[0].state = WorkerState.BUSY  # a's one worker runs a call; a's next waits
        p.settings.warm_spares = 0
        starts.seconds = 30.0  # starts stay under way
        p.binders = 4  # four calls wait for a worker
        # a holds a worker: its call waits for that one and evicts nobody
        assert p.provide_spare(0, exclude="a", homeless=0) == Progress.NONE and p.restarts["evicted"] == 0
        # f holds none: room for one start
        before = {w.tenant_id for w in p.workers}
        assert p.provide_spare(0, exclude="f", homeless=1) == Progress.AGAIN and p.restarts["evicted"] == 1
        (lost,) = before - {w.tenant_id for w in p.workers}
        assert p.provide_spare(0, exclude="f", homeless=1) == Progress.PENDING  # the start under way
        await until(lambda: any(w.state == WorkerState.STARTING for w in p.workers), "its start under way", 2)
        # f's other calls: that start is for it, nothing more is evicted
        for _ in range(3):
            assert p.provide_spare(0, exclude="f", homeless=1) == Progress.PENDING
        assert p.restarts["evicted"] == 1
        # the tenant that lost its worker waits for that start too: each worker left is the only
        # one of a tenant in use, which would pass its loss on in turn
        assert lost is not None
        assert p.provide_spare(0, exclude=lost, homeless=2) == Progress.PENDING and p.restarts["evicted"] == 1
        # a new tenant still makes room for its own start beside the one under way
        assert p.provide_spare(0, exclude="g", homeless=2) == Progress.AGAIN and p.restarts["evicted"] == 2


async def test_with_every_slot_serving_the_worker_bound_longest_ago_takes_its_turn(tmp_path: Path) -> None:
    async with pool(tmp_path, gpus(Device(0, "0")), max_workers=3, warm_spares=3) as (p, _, seen):
        await filled(p, 3)
        p.table = AdmissionTable.create(tmp_path / "admission", fronts=1, tenants=8, workers=8)
        fed = p.workers
        for i, (w, tenant) in enumerate(zip(fed, "bcd", strict=True)):
            bind(w, tenant, last_used=10.0)
            w.state, w.slot, w.bound_at = WorkerState.BUSY, i, 5.0 - i  # fronts keep each one's queue full
            p.table.admit(0, tenant, 1e6, 8, [i])
        p.settings.warm_spares = 0
        p.binders = 1  # tenant a's call waits for a worker
        assert not p.evict_one(exclude="a")  # nothing idle
        assert p.provide_spare(0, exclude="a") == Progress.PENDING  # not refused: a turn is coming
        turn = fed[2]  # bound at 3.0, the longest ago
        assert turn.retire_reason == "rotated" and turn in p.workers  # drained: its queue goes first
        assert all(w.retire_reason is None for w in fed[:2])
        assert p.provide_spare(0, exclude="a") == Progress.PENDING and fed[1].retire_reason is None  # one turn at a time
        p.table.clear_worker(turn.slot)  # its queue done
        turn.state = WorkerState.IDLE
        p.retire_drained()
        assert turn not in p.workers and p.restarts["rotated"] == 1 and seen.unbound == [turn]


async def test_a_leased_worker_takes_its_turn_when_its_call_ends_and_a_tenant_with_a_worker_waits_for_its_own(tmp_path: Path) -> None:
    async with pool(tmp_path, gpus(Device(0, "0")), max_workers=2, warm_spares=2) as (p, _, seen):
        await filled(p, 2)
        mine, theirs = p.workers
        bind(mine, "a", last_used=1.0)
        bind(theirs, "b", last_used=1.0)
        mine.state = theirs.state = WorkerState.BUSY  # leased calls, b's next one queued behind
        p.settings.warm_spares = 0
        p.binders = 1
        # a holds a worker: its call waits for that one, and takes nobody's turn
        assert p.provide_spare(0, exclude="a") == Progress.NONE and theirs.retire_reason is None
        # c holds none: the worker bound longest ago (both at 0: the first) is drained for it
        assert p.provide_spare(0, exclude="c") == Progress.PENDING and mine.retire_reason == "rotated"
        mine.state = WorkerState.IDLE  # its lease released: retired, not handed to a's next call
        p.retire_drained()
        assert mine not in p.workers and p.restarts["rotated"] == 1 and seen.unbound == [mine]


async def test_the_next_start_is_expected_one_start_per_start_ahead_of_it_at_the_driver(tmp_path: Path) -> None:
    async with pool(tmp_path, gpus(Device(0, "0", name="a")), max_workers=8, warm_spares=0, max_parallel_starts=8) as (p, starts, _):
        starts.seconds, starts.serial = 0.2, True
        assert p.start_eta(0) is None  # nothing measured yet
        p.spawn(p.devices[0])
        await until(lambda: p.start_times.alone() is not None, "the first start")
        t0 = time.monotonic()
        for _ in range(3):  # begun together: the driver makes them one after another
            p.spawn(p.devices[0])
        eta = p.start_eta(0)
        assert eta is not None and 0.1 < eta - t0 < 0.3  # the first under way, not the last
        await until(lambda: sum(1 for w in p.workers if w.state == WorkerState.SPARE) == 2, "the second spare")
        eta = p.start_eta(0)
        assert eta is not None and eta - time.monotonic() < 0.3  # the next now heads the queue
        await until(lambda: not any(w.state == WorkerState.STARTING for w in p.workers), "the last spare")
        t0 = time.monotonic()
        eta = p.start_eta(0)
        assert eta is not None and 0.1 < eta - t0 < 0.26  # one begun now: one start (the median as they came: 0.3)
        assert p.start_times.typical() == pytest.approx(0.3, abs=0.1)  # 0.2, then 0.2, 0.4, 0.6 as they came
        assert p.start_times.alone() == pytest.approx(0.2, abs=0.05)


async def test_with_a_slot_for_every_tenant_an_only_worker_in_use_waits_for_one_on_its_way(tmp_path: Path) -> None:
    async with pool(tmp_path, gpus(Device(0, "0")), max_workers=4, warm_spares=4) as (p, _, _seen):
        await filled(p, 4)
        b, c, d, second = p.workers
        now = time.monotonic()
        for w, tenant in ((b, "b"), (c, "c"), (d, "d")):
            bind(w, tenant, last_used=now)  # each in use, between two of its calls
        second.state = WorkerState.BINDING  # a spare being bound as b's second
        p.settings.warm_spares = 0
        p.binders = 1  # a's call waits for a worker
        # b, c, d and a: four tenants, four slots. Taking c's only worker would leave c to take
        # another's at its next call; a waits for the worker on its way instead
        assert p.provide_spare(0, exclude="a", homeless=1) == Progress.PENDING and p.restarts["evicted"] == 0
        bind(second, "b", last_used=now - 0.01)  # b holds two now: its least recently used goes
        assert p.provide_spare(0, exclude="a", homeless=1) == Progress.AGAIN and second not in p.workers
        assert {w.tenant_id for w in p.workers} == {"b", "c", "d"}


async def test_an_only_worker_in_use_goes_when_the_node_is_crowded_or_nothing_is_on_its_way(tmp_path: Path) -> None:
    async with pool(tmp_path, gpus(Device(0, "0")), max_workers=4, warm_spares=4) as (p, starts, _seen):
        await filled(p, 4)
        starts.seconds = 30.0  # starts stay under way
        now = time.monotonic()
        busy1, busy2, c, d = p.workers
        for w, tenant in ((busy1, "b"), (busy2, "b"), (c, "c"), (d, "d")):
            bind(w, tenant, last_used=now)
        busy1.state = busy2.state = WorkerState.BUSY  # b's two run long calls
        p.settings.warm_spares = 0
        p.binders = 2  # a's call and, later, e's wait for a worker
        # nothing on its way and b's workers busy: c's idle one (the least recently used) goes now
        # rather than a wait for one of b's long calls to end
        c.last_used = now - 0.01
        assert p.provide_spare(0, exclude="a", homeless=1) == Progress.AGAIN and c not in p.workers
        assert p.provide_spare(0, exclude="a", homeless=1) == Progress.PENDING  # a's start, in c's slot
        # crowded: five tenants want the four slots (b and d hold them; a, c and e wait, a start on
        # its way for a): d's only worker takes its turn for e
        assert p.crowded(0, homeless=3) and not p.crowded(0, homeless=2)
        assert [w.state for w in p.workers].count(WorkerState.STARTING) == 1
        assert p.provide_spare(0, exclude="e", homeless=3) == Progress.AGAIN and d not in p.workers


async def test_a_tenant_never_evicted_is_not_held_back_on_a_young_clock(tmp_path: Path) -> None:
    # `retire_idle_after_s` longer than the host's uptime: "evicted lately" must not read an
    # absent entry as a time
    async with pool(tmp_path, gpus(Device(0, "0")), max_workers=3, warm_spares=3, retire_idle_after_s=1e12) as (p, _, _seen):
        await filled(p, 3)
        b, c, starting = p.workers
        bind(b, "b", last_used=time.monotonic())
        bind(c, "c", last_used=time.monotonic())
        starting.state = WorkerState.STARTING
        p.settings.warm_spares = 0
        assert p.evict_one(exclude="a") and b not in p.workers
