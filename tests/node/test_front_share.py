"""A front's time between tenants (app/node/front_share.py): calls admitted behind another at
their worker take turns, a few per pass of the event loop, only while a call of a light tenant
(direct calls here, none queued) other than their own is in the front."""

from __future__ import annotations

import asyncio

from app.node.front_share import FrontShare


async def _pass() -> None:
    """One pass of the event loop: what a callback scheduled now runs before this returns."""
    await asyncio.sleep(0)


def _done(futs: list[asyncio.Future[None] | None]) -> int:
    return sum(1 for f in futs if f is not None and f.done())


async def test_nothing_waits_without_a_light_tenants_call_here() -> None:
    share = FrontShare(per_pass=1)
    share.admitted("flood", queued=True)
    assert share.turn("flood") is None  # nobody else is here
    share.admitted("flood", queued=False)
    assert share.turn("flood") is None  # its own direct call: it never waits on itself
    share.admitted("other", queued=False)
    share.admitted("other", queued=True)  # another tenant that queues too is not light
    assert share.turn("flood") is None and share.turn("other") is None


async def test_queued_calls_go_on_per_pass_while_a_light_tenants_call_is_here() -> None:
    share = FrontShare(per_pass=2)
    share.admitted("quiet", queued=False)
    share.admitted("flood", queued=True)
    futs = [share.turn("flood") for _ in range(5)]
    assert all(f is not None for f in futs) and share.waited == 5 and share.waiting == 5
    await _pass()
    assert _done(futs) == 2  # the first two, in the order they came
    assert futs[0] is not None and futs[0].done() and futs[1] is not None and futs[1].done()
    await _pass()
    assert _done(futs) == 4
    share.leave("quiet", queued=False)  # its call answered: the rest go on at the next pass
    await _pass()
    assert _done(futs) == 5 and share.waiting == 0
    assert share.turn("flood") is None


async def test_a_light_tenant_that_queues_stops_being_given_way() -> None:
    share = FrontShare(per_pass=1)
    share.admitted("quiet", queued=False)
    share.admitted("flood", queued=True)
    futs = [share.turn("flood") for _ in range(4)]
    await _pass()
    assert _done(futs) == 1
    share.admitted("quiet", queued=True)  # now it queues as well: both are heavy, neither waits
    await _pass()
    assert _done(futs) == 4
    share.leave("quiet", queued=True)  # light again
    assert share.turn("flood") is not None


async def test_a_cancelled_wait_takes_no_turn() -> None:
    share = FrontShare(per_pass=1)
    share.admitted("quiet", queued=False)
    share.admitted("flood", queued=True)
    first, second = share.turn("flood"), share.turn("flood")
    assert first is not None and second is not None
    first.cancel()  # its client went away
    await _pass()
    assert second.done() and not second.cancelled()


async def test_a_call_after_its_release_no_longer_counts_for_its_tenant() -> None:
    share = FrontShare(per_pass=1)
    share.admitted("quiet", queued=False)
    share.admitted("flood", queued=False)
    share.admitted("flood", queued=True)
    share.leave("flood", queued=True)  # released: the flood's direct call left makes it light
    assert share.turn("quiet") is not None  # a call of quiet's that queued would give way now
    share.leave("flood", queued=False)
    assert share.turn("quiet") is None


async def test_calls_of_two_tenants_keep_their_order_one_a_pass() -> None:
    share = FrontShare(per_pass=1)
    share.admitted("quiet", queued=False)
    for tenant in ("a", "b"):
        share.admitted(tenant, queued=True)
    order: list[str] = []

    async def call(tenant: str) -> None:
        turn = share.turn(tenant)
        assert turn is not None
        await turn
        order.append(tenant)

    tasks = [asyncio.create_task(call(t)) for t in ("a", "b", "a", "b")]
    seen = []
    for _ in range(4):
        await _pass()
        seen.append(len(order))
    assert all(b - a <= 1 for a, b in zip([0, *seen], seen, strict=False)) and seen[-1] < 4  # at most one a pass
    share.leave("quiet", queued=False)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == ["a", "b", "a", "b"]


async def test_a_light_tenant_is_given_way_for_the_linger_after_its_last_call() -> None:
    share = FrontShare(per_pass=1, linger_s=0.2)
    share.admitted("quiet", queued=False)
    share.leave("quiet", queued=False)  # its call answered: its next one is given way from its first step
    share.admitted("flood", queued=True)
    waiting = share.turn("flood")
    assert waiting is not None
    await asyncio.sleep(0.25)  # the linger is over: what waited goes on, and nothing waits after
    assert waiting.done() and share.waiting == 0
    assert share.turn("flood") is None


async def test_a_lingering_tenant_that_queues_or_calls_again_is_weighed_anew() -> None:
    share = FrontShare(per_pass=1, linger_s=60)
    share.admitted("quiet", queued=False)
    share.leave("quiet", queued=False)
    share.admitted("flood", queued=True)
    assert share.turn("flood") is not None  # lingering
    share.admitted("quiet", queued=True)  # it queues now: no longer light, lingering or not
    assert share.turn("flood") is None
    share.leave("quiet", queued=True)  # a call that queued leaves no linger behind
    assert share.turn("flood") is None
    share.admitted("quiet", queued=False)
    assert share.turn("quiet") is None  # a tenant never waits on its own linger
    share.leave("quiet", queued=False)
    assert share.turn("quiet") is None
    share.admitted("quiet", queued=True)
    assert share.turn("quiet") is None


async def test_the_oldest_lingers_end_first_and_a_renewed_one_moves_back() -> None:
    share = FrontShare(per_pass=1, linger_s=0.5)
    for tenant in ("a", "b"):
        share.admitted(tenant, queued=False)
        share.leave(tenant, queued=False)
    await asyncio.sleep(0.3)
    share.admitted("a", queued=False)
    share.leave("a", queued=False)  # renewed: now b's linger ends first
    await asyncio.sleep(0.3)  # b's is over, a's is not (0.2 s of it left)
    share.admitted("b", queued=True)
    assert share.turn("b") is not None  # gives way to a
    share.leave("b", queued=True)
    share.admitted("a", queued=True)  # a queues: nobody lingers now
    assert share.turn("a") is None


async def test_a_call_not_yet_admitted_waits_ahead_only_when_its_tenant_queues_here() -> None:
    share = FrontShare(per_pass=1)
    share.admitted("quiet", queued=False)
    assert share.turn_ahead("flood") is None  # nothing of the flood's queues here (yet)
    share.admitted("flood", queued=False)
    assert share.turn_ahead("flood") is None  # its call here went onto a free worker
    share.admitted("flood", queued=True)
    ahead, queued = share.turn_ahead("flood"), share.turn("flood")
    assert ahead is not None and queued is not None and share.waiting == 2
    assert share.turn_ahead("quiet") is None  # a light tenant never waits
    await _pass()
    assert ahead.done() and not queued.done()  # one a pass, in the order they came
    share.leave("quiet", queued=False)
    await _pass()
    assert queued.done() and share.turn_ahead("flood") is None  # no light tenant here any more


async def test_lingers_past_their_time_are_let_go_while_a_light_call_stays() -> None:
    """A front where a light tenant always has a call keeps no more lingering tenants than the
    last linger saw, however many tenants pass through it."""
    share = FrontShare(per_pass=1, linger_s=0.05)
    share.admitted("steady", queued=False)
    for i in range(100):
        share.admitted(f"t{i}", queued=False)
        share.leave(f"t{i}", queued=False)
    await asyncio.sleep(0.1)
    share.admitted("last", queued=False)
    share.leave("last", queued=False)
    assert share.lingering == 1
