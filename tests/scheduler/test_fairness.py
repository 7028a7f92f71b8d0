"""The fair-share policy on its own: reserve for quiet tenants, max-min hand-out of freed slots,
FIFO within a tenant, per-tenant concurrency, and what a refused call was blocked by."""

from __future__ import annotations

from app.scheduler.fairness import Blocked, FairShare, Ticket


def _flood(fair: FairShare, tenant: str, n: int, limit: int = 100) -> list[Ticket]:
    return [fair.submit(tenant, limit)[0] for _ in range(n)]


def test_a_flooding_tenant_leaves_the_reserve_to_a_quiet_one() -> None:
    fair = FairShare(max_workers=4, reserved=1)
    flood = _flood(fair, "a", 32)
    assert [t.granted for t in flood].count(True) == 3  # max_workers - reserved
    assert fair.running("a") == 3 and len(fair.queue("a")) == 29
    assert fair.blocked("a") == Blocked.FAIR_SHARE

    quiet, granted = fair.submit("b", 4)
    assert quiet.granted and granted == [quiet]  # starts at once, on the reserved slot
    assert fair.held == 4
    # a second quiet tenant waits for the next freed slot, and gets it before the flood
    other, granted = fair.submit("c", 4)
    assert not other.granted and granted == []
    assert fair.blocked("c") == Blocked.NO_CAPACITY
    assert fair.release(flood[0]) == [other]
    assert fair.running("a") == 2 and fair.running("c") == 1


def test_a_freed_slot_goes_to_the_waiting_tenant_with_fewest_running() -> None:
    fair = FairShare(max_workers=4, reserved=0)
    a = _flood(fair, "a", 6)  # a holds all 4 slots, 2 queued
    assert fair.running("a") == 4
    b = _flood(fair, "b", 3)  # b waits with 0 running
    c = _flood(fair, "c", 1)  # c too, arriving after b
    # freed slots go max-min, ties to the tenant waiting longest
    assert fair.release(a[0]) == [b[0]]  # b and c run 0; b waited longer
    assert fair.release(a[1]) == [c[0]]  # c runs 0
    assert fair.release(a[2]) == [a[4]]  # a and b run 1 each; a waited longer
    assert fair.release(b[0]) == [b[1]]  # b runs 0 now, a 2
    assert fair.release(c[0]) == [b[2]]  # b runs 1, a 2
    assert fair.release(a[3]) == [a[5]]  # FIFO within a
    assert fair.queued() == 0


def test_the_tenants_own_limit_and_fifo_order_hold() -> None:
    fair = FairShare(max_workers=8, reserved=1)
    calls = _flood(fair, "a", 5, limit=2)
    assert [t.granted for t in calls] == [True, True, False, False, False]
    assert fair.blocked("a") == Blocked.CONCURRENCY
    assert fair.release(calls[1]) == [calls[2]]  # the oldest waiter, whoever finished
    assert fair.release(calls[0]) == [calls[3]]


def test_a_withdrawn_call_gives_back_its_place_or_its_slot() -> None:
    fair = FairShare(max_workers=2, reserved=1)
    first, second, third = _flood(fair, "a", 3)
    assert first.granted and not second.granted
    assert fair.withdraw(second) == []  # left the queue: the next waiter is now at its head
    assert list(fair.queue("a")) == [third]
    late, _ = fair.submit("b", 4)
    assert late.granted
    # a granted call that is withdrawn before it ran passes its slot on
    assert fair.withdraw(first) == [third]
    fair.release(third)
    fair.release(late)
    assert fair.held == 0 and list(fair.tenants()) == []  # quiet tenants are forgotten


def test_one_worker_or_a_reserve_past_the_node_still_serves_everyone() -> None:
    fair = FairShare(max_workers=1, reserved=1)
    a, _ = fair.submit("a", 4)
    assert a.granted  # a tenant with nothing running may always take a free slot
    b, _ = fair.submit("b", 4)
    assert not b.granted and fair.release(a) == [b]
    wide = FairShare(max_workers=3, reserved=10)
    assert wide.share == 1 and [t.granted for t in _flood(wide, "a", 2)] == [True, False]
