"""A call that needs a worker start waits for it within its own deadline (its tenant's timeout from
its arrival), not the queue wait; it is refused at once when the measured start time cannot fit
that, and after the queue wait when nothing can start for it (failing starts); a busy context
is waited for within the deadline; a ready spare goes to the first call in line. Workers are fakes
whose starts take a set time."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from app.contract.errors import NoCapacity
from app.contract.messages import Outcome
from app.scheduler.devices import Device, Inventory
from app.scheduler.scheduler import _InLine
from app.worker.handle import WorkerState
from tests.helpers import fake_node, fake_workers, principal, until


async def test_a_call_waits_for_a_start_longer_than_the_queue_wait_that_fits_its_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_workers(monkeypatch, seconds=0.4)
    async with fake_node(tmp_path, max_workers=4, warm_spares=0, queue_wait_ms=100) as s:
        p = principal(timeout_ms=2000)
        t0 = time.monotonic()
        lease = await s.lease(p)  # no spare: it waits for the start its call began
        assert 0.35 < time.monotonic() - t0 < 1.5
        assert lease.worker.tenant_id == p.id and lease.worker.state == WorkerState.BUSY
        assert s.pool.start_times.typical() == pytest.approx(0.4, abs=0.1)
        s.release(lease, Outcome.OK)


async def test_a_call_whose_deadline_the_measured_start_time_cannot_meet_is_refused_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_workers(monkeypatch, seconds=0.5)
    async with fake_node(tmp_path, max_workers=4, warm_spares=1, queue_wait_ms=100) as s:  # start: the spare, 0.5 s
        first = await s.lease(principal(timeout_ms=5000))  # takes the spare; its replacement takes 0.5 s
        t0 = time.monotonic()
        with pytest.raises(NoCapacity, match="worker start takes about"):
            await s.lease(principal(timeout_ms=50))  # 0.1 s (the queue wait) to wait at most
        assert time.monotonic() - t0 < 0.05
        # one whose timeout leaves room waits for the same start
        second = await s.lease(principal(timeout_ms=5000))
        assert second.worker is not first.worker
        s.release(first, Outcome.OK)
        s.release(second, Outcome.OK)


async def test_starts_that_queued_behind_others_do_not_refuse_a_call_one_start_would_serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver makes contexts one after another, so starts begun together (a node's first
    spares) take 1, 2, 3 ... times one start; a call that one start would serve within its
    deadline waits for it instead of being refused for the queue those starts stood in."""
    starts = fake_workers(monkeypatch, seconds=0.15)
    starts.serial = True
    async with fake_node(tmp_path, max_workers=4, warm_spares=4, max_parallel_starts=4, queue_wait_ms=100) as s:
        await until(lambda: sum(1 for w in s.workers if w.state == WorkerState.SPARE) == 4, "four spares", 10)
        assert s.pool.start_times.typical() == pytest.approx(0.375, abs=0.1)  # the median of 0.15, 0.3, 0.45, 0.6
        held = [await s.lease(principal(timeout_ms=10_000)) for _ in range(3)]  # every slot but one bound
        spare = next(w for w in s.workers if w.state == WorkerState.SPARE)
        s.pool.retire(spare, "evicted")  # the last slot's spare gone: the next new tenant needs a start
        t0 = time.monotonic()
        lease = await s.lease(principal(timeout_ms=300))  # one start (0.15 s) fits its deadline; the median does not
        assert time.monotonic() - t0 < 0.3
        s.release(lease, Outcome.OK)
        for h in held:
            s.release(h, Outcome.OK)


async def test_a_busy_context_is_waited_for_past_the_queue_wait_within_the_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_workers(monkeypatch, seconds=0.01)
    devices = Inventory([Device(0, "0", name="fake0", configured_ceiling=1)], 0)
    async with fake_node(tmp_path, devices=devices, max_workers=4, warm_spares=1, queue_wait_ms=200) as s:
        busy = await s.lease(principal())  # the device's one context, running: nothing idle to evict
        asyncio.get_running_loop().call_later(0.5, s.release, busy, Outcome.OK)
        t0 = time.monotonic()
        lease = await s.lease(principal(timeout_ms=10_000))  # served once the busy call ends
        assert 0.45 < time.monotonic() - t0 < 2.0
        assert s.restarts["rotated"] == 1  # drained for it, retired when its call ended
        s.release(lease, Outcome.OK)
        busy = await s.lease(principal())
        t0 = time.monotonic()
        with pytest.raises(NoCapacity, match="no worker became available in time"):
            await s.lease(principal(timeout_ms=400))  # its deadline passes first
        assert 0.35 < time.monotonic() - t0 < 1.5
        s.release(busy, Outcome.OK)


async def test_failing_starts_refuse_after_the_queue_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    starts = fake_workers(monkeypatch, seconds=0.01)
    async with fake_node(tmp_path, max_workers=4, warm_spares=0, queue_wait_ms=200) as s:
        starts.fail = True  # the device backs off after each failed start
        t0 = time.monotonic()
        with pytest.raises(NoCapacity):
            await s.lease(principal(timeout_ms=10_000))
        assert time.monotonic() - t0 < 1.5
        assert s.restarts["start_failed"] >= 1


async def test_a_ready_spare_goes_to_the_first_call_in_line_it_fits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_workers(monkeypatch, seconds=0.01)
    gib = 1 << 30
    devices = Inventory([Device(0, "0", name="fake0", budget_bytes=4 * gib)], 0)
    async with fake_node(tmp_path, devices=devices, max_workers=4, warm_spares=1, context_overhead_bytes=0) as s:
        await until(lambda: s.pool.spare_for(0) is not None, "a spare")
        big, first, later = _InLine(8 * gib), _InLine(gib), _InLine(gib)
        s._line.extend([big, first, later])
        assert not s._first_in_line(later)  # a call ahead of it takes the spare first
        assert s._first_in_line(first)  # the one ahead of it needs more than the spare's device holds
        assert s._first_in_line(big)
        s._line.clear()
