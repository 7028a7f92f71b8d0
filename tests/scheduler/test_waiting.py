"""Calls that wait for a lease without a task (`Scheduler.queue_lease`): the release that frees a
slot hands the waiting call its tenant's idle worker at once, in arrival order; the queue wait,
a withdrawal and a full queue end a wait with nothing held; a slot with no idle worker binds one
in a task."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from app.contract.errors import NoCapacity, Rejected, RejectReason
from app.contract.messages import Outcome, Principal, Quota
from app.scheduler.leases import Lease, Waiting, WaitState
from app.scheduler.scheduler import Scheduler


def _principal(max_concurrency: int = 1, gpu_memory_bytes: int = 0) -> Principal:
    quota = Quota(
        gpu_memory_bytes=gpu_memory_bytes, max_concurrency=max_concurrency, requests_per_second=1000.0, max_functions=10,
        max_module_bytes=1 << 20, wasm_memory_bytes=64 << 20, timeout_ms=10_000, max_queued=100,
    )
    return Principal(f"t-{uuid.uuid4().hex[:12]}", "waiting", quota)


class _Calls:
    """The callbacks of queued calls, in the order they fired."""

    def __init__(self) -> None:
        self.granted: list[tuple[int, Lease]] = []
        self.failed: list[tuple[int, Exception]] = []

    def queue(self, s: Scheduler, p: Principal, n: int) -> Waiting:
        return s.queue_lease(p, lambda lease: self.granted.append((n, lease)), lambda exc: self.failed.append((n, exc)))


@asynccontextmanager
async def _leased(app_factory: Any, max_concurrency: int = 1, **settings: Any) -> AsyncIterator[tuple[Scheduler, Principal, Lease, _Calls]]:
    """A scheduler whose one tenant holds a lease (its first call, which binds its worker), and
    the callbacks of the calls the test queues behind it."""
    async with app_factory(**settings) as (_, platform):
        s: Scheduler = platform.scheduler
        p = _principal(max_concurrency=max_concurrency)
        yield s, p, await s.lease(p), _Calls()


async def test_queued_calls_take_the_released_worker_in_arrival_order_without_a_task(app_factory) -> None:
    async with _leased(app_factory, max_workers=2, queue_wait_ms=5000) as (s, p, first, calls):  # first binds the worker
        tasks = len(asyncio.all_tasks())
        queued = [calls.queue(s, p, n) for n in range(3)]
        assert [w.state for w in queued] == [WaitState.QUEUED] * 3 and calls.granted == []
        assert len(asyncio.all_tasks()) == tasks  # a timer each, no task
        s.release(first, Outcome.OK)
        assert [n for n, _ in calls.granted] == [0]  # granted within the release, no loop turn
        assert calls.granted[0][1].worker is first.worker
        for expected in (1, 2):
            s.release(calls.granted[-1][1], Outcome.OK)
            assert [n for n, _ in calls.granted][-1] == expected
        assert all(w.state == WaitState.GRANTED and w.timer is None for w in queued)
        s.release(calls.granted[-1][1], Outcome.OK)
        assert s.fair.running(p.id) == 0 and s.fair.queued() == 0 and calls.failed == []


async def test_the_queue_wait_refuses_a_call_and_leaves_nothing_held(app_factory) -> None:
    async with _leased(app_factory, max_workers=2, queue_wait_ms=100) as (s, p, running, calls):
        waiting = calls.queue(s, p, 0)
        await asyncio.sleep(0.3)
        assert waiting.state == WaitState.FAILED and calls.granted == []
        [(_, exc)] = calls.failed
        assert isinstance(exc, Rejected) and exc.reason == RejectReason.CONCURRENCY
        assert not s.fair.queue(p.id)
        s.release(running, Outcome.OK)
        assert s.fair.running(p.id) == 0


async def test_a_withdrawn_call_gives_its_place_to_the_next(app_factory) -> None:
    async with _leased(app_factory, max_workers=2, queue_wait_ms=5000) as (s, p, running, calls):
        gone, next_one = calls.queue(s, p, 0), calls.queue(s, p, 1)
        s.withdraw(gone)
        assert gone.state == WaitState.WITHDRAWN and gone.timer is not None and gone.timer.cancelled()
        s.release(running, Outcome.OK)
        assert [n for n, _ in calls.granted] == [1] and next_one.state == WaitState.GRANTED
        s.withdraw(next_one)  # granted: the holder's to release, nothing to withdraw
        assert s.fair.running(p.id) == 1
        s.release(calls.granted[0][1], Outcome.OK)
        assert s.fair.running(p.id) == 0 and calls.failed == []


async def test_a_full_queue_refuses_at_once(app_factory) -> None:
    async with _leased(app_factory, max_workers=2, queue_wait_ms=5000, queue_limit=2) as (s, p, running, calls):
        queued = [calls.queue(s, p, n) for n in range(2)]
        with pytest.raises(Rejected) as refused:
            calls.queue(s, p, 2)
        assert refused.value.reason == RejectReason.QUEUE_FULL
        for w in queued:
            s.withdraw(w)
        s.release(running, Outcome.OK)
        assert s.fair.running(p.id) == 0 and s.fair.queued() == 0


async def test_a_slot_with_no_idle_worker_binds_one_in_a_task(app_factory) -> None:
    async with _leased(app_factory, max_concurrency=2, max_workers=3, warm_spares=1, queue_wait_ms=5000) as (s, p, first, calls):
        waiting = calls.queue(s, p, 0)  # a slot is free, the tenant's one worker is busy
        assert waiting.state == WaitState.BINDING and waiting.task is not None
        await asyncio.wait_for(waiting.task, 10)
        [(_, second)] = calls.granted
        assert second.worker is not first.worker and second.worker.tenant_id == p.id
        s.release(first, Outcome.OK)
        s.release(second, Outcome.OK)
        assert s.fair.running(p.id) == 0


async def test_a_call_withdrawn_while_its_worker_binds_gives_its_slot_back(app_factory) -> None:
    async with _leased(app_factory, max_concurrency=2, max_workers=3, warm_spares=1, queue_wait_ms=5000) as (s, p, first, calls):
        waiting = calls.queue(s, p, 0)
        assert waiting.state == WaitState.BINDING and s.fair.running(p.id) == 2
        task = waiting.task
        assert task is not None
        s.withdraw(waiting)
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)  # the task's done callback
        assert waiting.state == WaitState.WITHDRAWN and calls.granted == [] and calls.failed == []
        assert s.fair.running(p.id) == 1
        s.release(first, Outcome.OK)
        assert s.fair.running(p.id) == 0


async def test_a_cap_no_device_can_hold_fails_the_queued_call(app_factory) -> None:
    mib = 1 << 20
    async with app_factory(max_workers=2, queue_wait_ms=5000, context_overhead_bytes=100 * mib, device_memory_bytes=800 * mib) as (_, platform):
        s: Scheduler = platform.scheduler
        s.devices[0].budget_bytes = 800 * mib
        p = _principal(max_concurrency=1, gpu_memory_bytes=750 * mib)
        calls = _Calls()
        waiting = calls.queue(s, p, 0)
        assert waiting.task is not None
        with pytest.raises(NoCapacity):
            await waiting.task
        await asyncio.sleep(0)
        assert waiting.state == WaitState.FAILED and isinstance(calls.failed[0][1], NoCapacity)
        assert s.fair.running(p.id) == 0


async def test_a_waiting_lease_granted_as_its_caller_is_cancelled_is_given_back(app_factory) -> None:
    """The release grants the waiting `lease()` and the caller is cancelled before it resumes
    (the supervisor cancels a traced wait whose front went away): the lease goes back."""
    async with app_factory(max_workers=2, queue_wait_ms=5000) as (_, platform):
        s: Scheduler = platform.scheduler
        p = _principal(max_concurrency=1)
        running = await s.lease(p)
        waiter = asyncio.create_task(s.lease(p))
        await asyncio.sleep(0)
        assert s.fair.queued() == 1
        s.release(running, Outcome.OK)  # grants the waiter's future within the release
        waiter.cancel()  # before the waiter resumed
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert s.fair.running(p.id) == 0 and s.fair.queued() == 0
        again = s.lease_now(p)
        assert again is not None and again.worker is running.worker  # idle again, not leaked
        s.release(again, Outcome.OK)
