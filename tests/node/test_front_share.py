"""A front's time between tenants (app/node/front_share.py): a tenant whose calls queue at its
workers takes turns, a few per pass of the event loop, only while another tenant's direct call
is in the front."""

from __future__ import annotations

import asyncio

from app.node.front_share import FrontShare


async def _pass() -> None:
    """One pass of the event loop: what a callback scheduled now runs before this returns."""
    await asyncio.sleep(0)


def _done(futs: list[asyncio.Future[None] | None]) -> int:
    return sum(1 for f in futs if f is not None and f.done())


async def test_no_call_waits_without_another_tenants_direct_call_here() -> None:
    share = FrontShare(per_pass=1)
    assert share.admitted("flood", depth=3) is False  # queued behind three: the tenant queues
    assert share.turn("flood") is None  # nobody else is here
    assert share.admitted("flood", depth=0) is True  # its own direct call
    assert share.admitted("flood", depth=2) is False
    assert share.turn("flood") is None  # never waits on its own tenant's calls
    assert share.admitted("quiet", depth=0) is True
    assert share.turn("quiet") is None  # a tenant that does not queue never waits


async def test_a_queuing_tenant_goes_on_per_pass_while_another_tenants_call_is_here() -> None:
    share = FrontShare(per_pass=2)
    share.admitted("quiet", depth=0)
    share.admitted("flood", depth=1)
    futs = [share.turn("flood") for _ in range(5)]
    assert all(f is not None for f in futs) and share.waited == 5 and share.waiting == 5
    await _pass()
    assert _done(futs) == 2  # the first two, in the order they came
    assert futs[0] is not None and futs[0].done() and futs[1] is not None and futs[1].done()
    await _pass()
    assert _done(futs) == 4
    share.leave("quiet")  # the other tenant's call answered: the rest go on at the next pass
    await _pass()
    assert _done(futs) == 5 and share.waiting == 0


async def test_the_rest_go_at_once_when_the_other_call_leaves() -> None:
    share = FrontShare(per_pass=1)
    share.admitted("quiet", depth=0)
    share.admitted("flood", depth=4)
    futs = [share.turn("flood") for _ in range(10)]
    share.leave("quiet")
    await _pass()
    assert _done(futs) == 10
    assert share.turn("flood") is None  # nobody else here now


async def test_a_cancelled_wait_takes_no_turn() -> None:
    share = FrontShare(per_pass=1)
    share.admitted("quiet", depth=0)
    share.admitted("flood", depth=1)
    first, second = share.turn("flood"), share.turn("flood")
    assert first is not None and second is not None
    first.cancel()  # its client went away
    await _pass()
    assert second.done() and not second.cancelled()


async def test_a_direct_call_ends_its_tenants_queuing_and_forget_clears_it() -> None:
    share = FrontShare(per_pass=1)
    share.admitted("quiet", depth=0)
    share.admitted("flood", depth=1)
    assert share.turn("flood") is not None
    share.admitted("flood", depth=0)  # its workers caught up
    assert share.turn("flood") is None
    share.admitted("other", depth=2)
    share.forget("other")  # its routes went
    assert share.turn("other") is None


async def test_waiting_calls_resume_their_tasks_in_order() -> None:
    share = FrontShare(per_pass=1)
    share.admitted("quiet", depth=0)
    share.admitted("flood", depth=1)
    order: list[int] = []

    async def call(i: int) -> None:
        turn = share.turn("flood")
        assert turn is not None
        await turn
        order.append(i)

    tasks = [asyncio.create_task(call(i)) for i in range(4)]
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == [0, 1, 2, 3]


async def test_once_only_its_own_direct_calls_are_here_the_rest_go_at_once() -> None:
    share = FrontShare(per_pass=1)
    share.admitted("flood", depth=0)  # one of its own calls went straight to a free worker
    share.admitted("quiet", depth=0)
    share.admitted("flood", depth=2)
    futs = [share.turn("flood") for _ in range(4)]
    await _pass()
    assert _done(futs) == 1
    share.leave("quiet")  # the flood's own direct call is still here: it gives way to no one
    await _pass()
    assert _done(futs) == 4 and share.waiting == 0


async def test_calls_of_two_queuing_tenants_keep_their_order() -> None:
    share = FrontShare(per_pass=1)
    share.admitted("quiet", depth=0)
    share.admitted("a", depth=1)
    share.admitted("b", depth=1)
    order: list[str] = []

    async def call(tenant: str) -> None:
        turn = share.turn(tenant)
        assert turn is not None
        await turn
        order.append(tenant)

    tasks = [asyncio.create_task(call(t)) for t in ("a", "b", "a", "b")]
    for _ in range(3):
        await _pass()
    assert len(order) < 4  # still one a pass
    share.leave("quiet")
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == ["a", "b", "a", "b"]
