"""Spares kept ahead of new tenants (app/scheduler/spares.py and the scheduler acting on it): the
measured start time and arrival rate, the target between warm_spares and max_warm_spares, spares
that grow under a burst of new tenants and shrink back when it stops, within max_workers, the
device's ceiling and budget; workers are fakes (no process), the arrival clock a fake one."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from app.contract.messages import Outcome
from app.scheduler.devices import Device, Inventory
from app.scheduler.scheduler import Scheduler
from app.scheduler.spares import ArrivalRate, StartTimes, room_spares, spare_target, surge_rate
from app.worker.handle import WorkerState
from tests.helpers import fake_node, fake_workers, principal, until

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_start_time_is_the_median_of_recent_starts() -> None:
    t = StartTimes(keep=4)
    assert t.typical() is None
    for s in (0.2, 0.3, 5.0, 0.25):  # one slow start does not move it
        t.add(s)
    assert t.typical() == pytest.approx(0.275)
    for s in (1.0, 1.0, 1.0):  # only the recent ones count
        t.add(s)
    assert t.typical() == pytest.approx(1.0)


def test_one_start_alone_is_each_start_over_the_starts_it_queued_behind() -> None:
    t = StartTimes(keep=4)
    assert t.alone() is None
    for ahead, s in enumerate((0.2, 0.4, 0.6, 0.8)):  # begun together: the driver made them one after another
        t.add(s, ahead)
    assert t.typical() == pytest.approx(0.5)  # as they came
    assert t.alone() == pytest.approx(0.2)  # one start
    t.add(0.3)  # one begun with nothing under way counts as it took
    assert t.alone() == pytest.approx(0.2)


def test_the_arrival_rate_follows_a_burst_and_decays_when_it_stops() -> None:
    clock = Clock()
    r = ArrivalRate(tau_s=1.0, clock=clock)
    assert r.rate() == 0
    for _ in range(8):  # eight new tenants within 80 ms
        r.note()
        clock.now += 0.01
    assert 7 < r.rate() < 8
    clock.now += 5
    assert r.rate() < 0.06


def test_the_target_stays_between_warm_spares_and_max_warm_spares() -> None:
    assert spare_target(0.0, 0.5, 1, warm_spares=1, max_warm_spares=8) == 1
    assert spare_target(0.1, 0.5, 1, warm_spares=1, max_warm_spares=8) == 1  # a decayed rate keeps no extra
    assert spare_target(10.0, 0.5, 1, warm_spares=1, max_warm_spares=8) == 6  # 5 arrive within a start, + 1
    assert spare_target(100.0, 0.5, 1, warm_spares=1, max_warm_spares=8) == 8
    assert spare_target(10.0, 0.5, 2, warm_spares=1, max_warm_spares=8) == 3  # spread over the devices
    assert spare_target(10.0, None, 1, warm_spares=2, max_warm_spares=8) == 2  # no start measured yet
    assert spare_target(100.0, 0.5, 1, warm_spares=3, max_warm_spares=1) == 3  # warm_spares wins
    assert spare_target(100.0, 0.5, 1, warm_spares=0, max_warm_spares=8) == 0  # none kept at all


def test_a_share_of_the_room_is_kept_warm_within_the_same_bounds() -> None:
    assert room_spares(64, 1, 0.25) == 16
    assert room_spares(64, 2, 0.25) == 8  # spread over the devices
    assert room_spares(4, 1, 0.25) == 1 and room_spares(3, 1, 0.25) == 0
    assert room_spares(-2, 1, 0.25) == 0 and room_spares(64, 1, 0.0) == 0
    assert spare_target(0.0, None, 1, warm_spares=1, max_warm_spares=16, room=16) == 16  # before any start
    assert spare_target(0.0, 0.5, 1, warm_spares=1, max_warm_spares=8, room=16) == 8  # max_warm_spares
    assert spare_target(10.0, 0.5, 1, warm_spares=1, max_warm_spares=16, room=2) == 6  # arrivals above the room
    assert spare_target(0.0, 0.5, 1, warm_spares=0, max_warm_spares=16, room=16) == 0  # none kept at all


def test_the_surge_rate_keeps_twice_the_spares() -> None:
    for target, devices in ((1, 1), (3, 1), (2, 2), (4, 1)):
        assert spare_target(surge_rate(target, 0.4, devices), 0.4, devices, warm_spares=1, max_warm_spares=100) == 2 * target
    r = ArrivalRate(tau_s=1.0, clock=Clock())
    r.at_least(5.0)
    r.at_least(2.0)  # never lowers it
    assert r.rate() == pytest.approx(5.0)


def _spares(s: Scheduler) -> Counter[int]:
    return Counter(w.device_index for w in s.workers if w.state in (WorkerState.SPARE, WorkerState.STARTING))


def _burst(s: Scheduler, clock: Clock, tenants: int) -> None:
    """`tenants` new tenants' binds as the arrival rate sees them (the fake clock stands still)."""
    s.pool.arrivals = ArrivalRate(tau_s=1.0, clock=clock)
    for _ in range(tenants):
        s.pool.arrivals.note()


async def test_spares_grow_under_a_burst_of_new_tenants_and_shrink_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_workers(monkeypatch, seconds=0.2)
    async with fake_node(tmp_path, max_workers=20, warm_spares=1, max_warm_spares=4, retire_idle_after_s=0) as s:
        clock = Clock()
        s.pool.arrivals = ArrivalRate(tau_s=1.0, clock=clock)
        assert s.pool.spare_target() == 1
        # new tenants bound one after another, each finding a spare: each bind counts as an arrival
        for _ in range(6):
            await until(lambda: any(w.state == WorkerState.SPARE for w in s.workers), "a spare ready", 5)
            lease = await s.lease(principal())
            s.release(lease, Outcome.OK)
        assert s.pool.arrivals.rate() == pytest.approx(6.0)  # the fake clock stood still
        assert s.pool.spare_target() == 2  # 6/s x 0.2 s: 1.2 arrive within a start, + 1
        _burst(s, clock, 40)
        assert s.pool.spare_target() == 4  # max_warm_spares
        s.pool.ensure_spares()
        await until(lambda: sum(1 for w in s.workers if w.state == WorkerState.SPARE) == 4, "four spares ready", 5)
        assert _spares(s)[0] == 4
        clock.now += 10  # the burst stopped: back to warm_spares, the extra spares retired
        await until(lambda: _spares(s)[0] == 1, "one spare left", 5)
        assert s.restarts["surplus_spare"] == 3


async def test_extra_spares_stay_within_max_workers_and_the_devices_ceilings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_workers(monkeypatch, seconds=0.02)
    clock = Clock()
    devices = Inventory([Device(0, "0", name="fake0", configured_ceiling=2), Device(1, "1", name="fake1")], 0)
    async with fake_node(tmp_path, devices=devices, max_workers=6, warm_spares=1, max_warm_spares=8, max_parallel_starts=8) as s:
        _burst(s, clock, 1000)
        assert s.pool.spare_target() == 8
        s.pool.ensure_spares()
        await until(lambda: sum(1 for w in s.workers if w.state == WorkerState.SPARE) == 6, "the node's slots full of spares", 5)
        s.pool.ensure_spares()
        assert len(s.pool.alive()) == 6  # max_workers
        assert s.devices[0].contexts == 2 and s.devices[1].contexts == 4  # device 0 at its ceiling


async def test_extra_spares_give_way_to_a_tenant_whose_cap_needs_their_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_workers(monkeypatch, seconds=0.02)
    clock = Clock()
    devices = Inventory([Device(0, "0", budget_bytes=1000 * MIB, name="fake0")], 100 * MIB)
    async with fake_node(
        tmp_path, devices=devices, max_workers=20, warm_spares=1, max_warm_spares=8, queue_wait_ms=300, default_gpu_memory_bytes=100 * MIB,
    ) as s:
        _burst(s, clock, 1000)
        s.pool.ensure_spares()
        await until(lambda: sum(1 for w in s.workers if w.state == WorkerState.SPARE) == 8, "eight spares in the budget", 5)
        big = principal(gpu_memory_bytes=500 * MIB)
        lease = await s.lease(big)  # 8 x 100 MiB of spares + 500 MiB would not fit: three give way
        assert lease.worker.tenant_id == big.id
        assert s.restarts["surplus_spare"] == 3
        await until(lambda: not any(w.state == WorkerState.STARTING for w in s.workers), "no start under way", 5)
        assert s.devices[0].committed_bytes <= 1000 * MIB
        s.release(lease, Outcome.OK)


async def test_each_new_tenant_that_finds_no_spare_doubles_the_spares_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of new tenants, each call after the last: binds alone come only as fast as starts,
    so each tenant that has to wait for one doubles what is kept ahead, up to max_warm_spares."""
    fake_workers(monkeypatch, seconds=0.2)
    async with fake_node(tmp_path, max_workers=20, warm_spares=1, max_warm_spares=6, retire_idle_after_s=60) as s:
        clock = Clock()  # stands still: the arrival rate does not decay during the test
        s.pool.arrivals = ArrivalRate(tau_s=1.0, clock=clock)
        await s.lease(principal())  # binds the ready spare; its replacement starts
        base = s.pool.spare_target()  # 1 (2 where a loaded host's fake start took over 0.25 s)
        second = asyncio.create_task(s.lease(principal()))  # finds none ready: waits for a start
        await until(lambda: s.pool.spare_target() == 2 * base, "twice the spares", 2)
        third = asyncio.create_task(s.lease(principal()))
        await until(lambda: s.pool.spare_target() == min(6, 4 * base), "twice again", 2)
        await until(lambda: _spares(s)[0] >= min(6, 4 * base) - 1, "the spares under way", 2)
        fourth = asyncio.create_task(s.lease(principal()))
        await until(lambda: s.pool.spare_target() == 6, "max_warm_spares", 2)
        for t in (second, third, fourth):
            await asyncio.wait_for(t, 5)
        await until(lambda: sum(1 for w in s.workers if w.state == WorkerState.SPARE) == 6, "six spares ready", 5)


async def test_an_idle_node_keeps_a_share_of_its_free_slots_warm_and_less_as_tenants_take_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_workers(monkeypatch, seconds=0.02)
    async with fake_node(tmp_path, max_workers=20, warm_spares=1, max_warm_spares=16, spare_room_share=0.25, retire_idle_after_s=0) as s:
        clock = Clock()  # no arrivals: only the room's share counts
        s.pool.arrivals = ArrivalRate(tau_s=1.0, clock=clock)
        assert s.pool.spare_target() == 5  # a quarter of 20 slots
        await until(lambda: sum(1 for w in s.workers if w.state == WorkerState.SPARE) == 5, "five spares ready", 5)
        leases = []
        for _ in range(12):  # twelve tenants take slots: a quarter of the 8 left
            await until(lambda: any(w.state == WorkerState.SPARE for w in s.workers), "a spare ready", 5)
            leases.append(await s.lease(principal()))
        s.pool.arrivals = ArrivalRate(tau_s=1.0, clock=clock)  # forget the binds' arrivals
        assert s.pool.spare_target() == 2
        await until(lambda: _spares(s)[0] == 2, "the spares past the room's share retired", 5)
        for lease in leases:
            s.release(lease, Outcome.OK)
        assert s.pool.spare_target() == 2  # bound idle tenants still hold their slots


async def test_no_room_share_keeps_warm_spares_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_workers(monkeypatch, seconds=0.02)
    async with fake_node(tmp_path, max_workers=20, warm_spares=1, max_warm_spares=16, spare_room_share=0.0) as s:
        s.pool.arrivals = ArrivalRate(tau_s=1.0, clock=Clock())
        assert s.pool.spare_target() == 1
        await until(lambda: _spares(s)[0] == 1, "one spare", 5)
        await asyncio.sleep(0.1)
        assert _spares(s)[0] == 1


async def test_spares_kept_for_the_room_give_way_before_a_tenants_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The room's spares fill a device's budget but for a new tenant's default cap; a tenant whose
    cap needs more takes it from them, never from another tenant's idle worker."""
    fake_workers(monkeypatch, seconds=0.02)
    devices = Inventory([Device(0, "0", budget_bytes=1000 * MIB, name="fake0")], 100 * MIB)
    async with fake_node(
        tmp_path, devices=devices, max_workers=20, warm_spares=1, max_warm_spares=16, spare_room_share=0.5,
        default_gpu_memory_bytes=100 * MIB, queue_wait_ms=300,
    ) as s:
        await until(lambda: not any(w.state == WorkerState.STARTING for w in s.workers), "the spares started", 5)
        assert sum(1 for w in s.workers if w.state == WorkerState.SPARE) == 8  # 8 x 100 MiB + room for 100 + its context
        a, b = principal(gpu_memory_bytes=300 * MIB), principal(gpu_memory_bytes=300 * MIB)
        lease = await s.lease(a)
        s.release(lease, Outcome.OK)
        lease = await s.lease(b)
        s.release(lease, Outcome.OK)
        assert s.restarts["evicted"] == 0 and s.restarts["surplus_spare"] >= 1
        assert {w.tenant_id for w in s.workers if w.state == WorkerState.IDLE} == {a.id, b.id}
        await until(lambda: not any(w.state == WorkerState.STARTING for w in s.workers), "no start under way", 5)
        assert s.devices[0].committed_bytes <= 1000 * MIB


def test_a_new_tenant_short_of_a_spare_doubles_the_arrivals_part_not_the_rooms(tmp_path: Path) -> None:
    from app.scheduler.pool import WorkerPool
    from tests.helpers import make_settings

    settings = make_settings("sqlite://", tmp_path, max_workers=40, warm_spares=1, max_warm_spares=32, spare_room_share=0.5)
    pool = WorkerPool(settings, Inventory.cpu(settings.context_overhead_bytes), factory=lambda d: None)  # type: ignore[arg-type,return-value]
    pool.arrivals = ArrivalRate(tau_s=1.0, clock=Clock())
    pool.start_times.add(0.4)
    pool._closed = True  # counts only: nothing starts
    assert pool.spare_target() == 20 and pool.spare_target(room=False) == 1
    pool.spares_short()
    assert pool.spare_target(room=False) == 2 and pool.spare_target() == 20


async def test_a_spare_bound_after_waiting_counts_as_used_from_its_bind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a spare's `last_used` is its start: bound after waiting longer than retire_idle_after_s, it
    # must not read as unused (the first to evict) until its first call ends
    fake_workers(monkeypatch)
    async with fake_node(tmp_path, max_workers=2, warm_spares=1, retire_idle_after_s=0.2) as s:
        await until(lambda: any(w.state == WorkerState.SPARE for w in s.workers), "a spare", 2)
        await asyncio.sleep(0.3)
        lease = await s.lease(principal())
        assert s.pool.last_used(lease.worker) > lease.worker.bound_at - 0.05
        s.release(lease, Outcome.OK)
