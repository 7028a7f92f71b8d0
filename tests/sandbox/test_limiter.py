"""The fair limiter with real asyncio tasks: who gets a slot, in which order (never how fast)."""

from __future__ import annotations

import asyncio

import pytest

from app.sandbox.limiter import FairLimiter


class Recorder:
    """Tasks that take a slot, note when they got it, and hold it until told to go."""

    def __init__(self, limiter: FairLimiter) -> None:
        self.limiter = limiter
        self.order: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def _job(self, tenant: str, name: str) -> None:
        async with self.limiter.slot(tenant):
            self.order.append(name)
            await self.gates[name].wait()

    async def submit(self, tenant: str, name: str) -> None:
        self.gates[name] = asyncio.Event()
        self.tasks[name] = asyncio.create_task(self._job(tenant, name))
        await settle()

    async def finish(self, name: str) -> None:
        self.gates[name].set()
        await self.tasks[name]
        await settle()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_at_most_slots_at_once_and_one_per_tenant() -> None:
    r = Recorder(FairLimiter(2))
    for name in ("a1", "a2", "a3"):
        await r.submit("a", name)
    assert r.order == ["a1"]  # a tenant never holds two slots, even with one free
    assert (r.limiter.running, r.limiter.waiting) == (1, 2)
    await r.submit("b", "b1")
    await r.submit("c", "c1")
    assert r.order == ["a1", "b1"]  # the node-wide bound: c waits
    await r.finish("b1")
    assert r.order == ["a1", "b1", "c1"]
    await r.finish("a1")
    assert r.order[-1] == "a2"  # a's next, in arrival order
    await r.finish("a2")
    await r.finish("c1")
    await r.finish("a3")
    assert r.order == ["a1", "b1", "c1", "a2", "a3"]
    assert (r.limiter.running, r.limiter.waiting) == (0, 0)


async def test_a_tenant_with_a_queue_does_not_keep_out_a_newcomer() -> None:
    """Two tenants each keep a queue of compiles; a third tenant's one compile, submitted after
    all of them, gets the first slot that frees, not the next of the busy tenants."""
    r = Recorder(FairLimiter(2))
    for i in range(1, 4):
        await r.submit("a", f"a{i}")
        await r.submit("b", f"b{i}")
    await r.submit("q", "q1")
    assert r.order == ["a1", "b1"]
    await r.finish("a1")
    assert r.order[-1] == "q1"  # a2 arrived before q1, but a was just served
    await r.finish("b1")
    assert r.order[-1] == "a2"  # a was served longer ago than b
    await r.finish("q1")
    assert r.order[-1] == "b2"
    for name in ("a2", "b2", "a3", "b3"):
        await r.finish(name)
    assert r.order == ["a1", "b1", "q1", "a2", "b2", "a3", "b3"]


async def test_fifo_within_a_tenant_and_ties_go_to_the_oldest() -> None:
    r = Recorder(FairLimiter(1))
    await r.submit("x", "x1")
    await r.submit("y", "y1")
    await r.submit("z", "z1")
    await r.submit("y", "y2")
    await r.finish("x1")
    assert r.order[-1] == "y1"  # y and z never served: the older request wins
    await r.finish("y1")
    assert r.order[-1] == "z1"
    await r.finish("z1")
    assert r.order[-1] == "y2"
    await r.finish("y2")


async def test_a_cancelled_waiter_leaves_the_queue_and_a_cancelled_holder_frees_its_slot() -> None:
    r = Recorder(FairLimiter(1))
    await r.submit("a", "a1")
    await r.submit("b", "b1")
    await r.submit("c", "c1")
    r.tasks["b1"].cancel()  # gave up while waiting (a deploy whose client went away)
    with pytest.raises(asyncio.CancelledError):
        await r.tasks["b1"]
    assert r.limiter.waiting == 1
    await r.finish("a1")
    assert r.order == ["a1", "c1"]
    r.tasks["c1"].cancel()  # cancelled while holding the slot
    with pytest.raises(asyncio.CancelledError):
        await r.tasks["c1"]
    await settle()
    await r.submit("a", "a2")
    assert r.order == ["a1", "c1", "a2"]
    await r.finish("a2")
    assert (r.limiter.running, r.limiter.waiting) == (0, 0)


async def test_granted_while_being_cancelled_hands_the_slot_on() -> None:
    limiter = FairLimiter(1)
    await limiter.acquire("a")
    waiter = asyncio.create_task(limiter.acquire("b"))
    await settle()
    limiter.release("a")  # grants b's future...
    waiter.cancel()  # ...and b is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert limiter.running == 0
    await asyncio.wait_for(limiter.acquire("c"), 5)  # the slot was not lost
    assert limiter.running == 1
