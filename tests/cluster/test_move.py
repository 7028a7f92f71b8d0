"""Per-node limits during a tenant's move, on a real cluster: a tenant's max_concurrency holds on
the node the balancer keeps it on, and, once that node is killed with -9 or drained, on the node
its calls move to; what a client sees meanwhile is counted (docs/operations.md, "During a move")."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.cluster.helpers import Cluster, cluster, needs_cluster

pytestmark = needs_cluster

LIMIT = 2  # the tenant's max_concurrency
CALLERS = 4 * LIMIT  # always more callers than the limit: the limit, not the callers, bounds the peak
SPAN_MS = b"150"
MOVE_BOUND_S = 10.0  # as for any dead node's tenants (test_failover)


@dataclass
class Call:
    sent: float  # monotonic
    status: int  # 0: cut short (its node died mid-answer)
    code: str  # the error envelope's code, "" on 200
    node: str  # the node that answered last, as nginx names it
    span: tuple[int, int] | None  # the guest's own start and end (CLOCK_REALTIME ns), on 200


def peak(spans: list[tuple[int, int]]) -> int:
    """The most guests running at one instant, by their own clocks (the nodes share a host)."""
    running = most = 0
    for _, step in sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans]):
        running += step
        most = max(most, running)
    return most


async def _caller(client: httpx.AsyncClient, key: dict[str, str], until: float, log: list[Call]) -> None:
    while time.monotonic() < until:
        sent = time.monotonic()
        try:
            r = await client.post("/v1/functions/span/invoke", content=SPAN_MS, headers=key)
        except httpx.TransportError:
            log.append(Call(sent, 0, "cut", "", None))
            await asyncio.sleep(0.05)
            continue
        node = r.headers.get("x-tensorwasm-node", "").split(", ")[-1]
        if r.status_code == 200:
            start, end = map(int, r.text.split())
            log.append(Call(sent, 200, "", node, (start, end)))
        else:
            log.append(Call(sent, r.status_code, r.json()["error"]["code"], node, None))  # always the envelope
            await asyncio.sleep(float(r.headers.get("retry-after", "0.1")) / 4)


def _tenant_on(c: Cluster, address: str, span: bytes) -> dict[str, str]:
    """A tenant of max_concurrency LIMIT that the ring places on the node at `address`."""
    for _ in range(24):
        _, key = c.tenant("move", max_concurrency=LIMIT, timeout_ms=30_000)
        r = c.deploy(key, "span", span)
        assert r.status_code == 201, r.text
        if r.headers["x-tensorwasm-node"].split(", ")[-1] == address:
            return key
    raise AssertionError(f"no tenant landed on {address} in 24 tries")


async def _callers_around(c: Cluster, key: dict[str, str], event: Callable[[], object]) -> tuple[list[Call], float]:
    """CALLERS callers of the tenant for 3 s, then `event` (a node killed or drained), then
    MOVE_BOUND_S more: every call's record, and when the event came (monotonic)."""
    log: list[Call] = []
    async with httpx.AsyncClient(base_url=c.url, timeout=60, limits=httpx.Limits(max_connections=CALLERS * 2)) as client:
        assert (await client.post("/v1/functions/span/invoke", content=b"1", headers=key)).status_code == 200  # warm
        until = time.monotonic() + 3 + MOVE_BOUND_S
        callers = [asyncio.create_task(_caller(client, key, until, log)) for _ in range(CALLERS)]
        await asyncio.sleep(3)
        event()
        at = time.monotonic()
        await asyncio.gather(*callers)
    return log, at


def test_a_tenants_concurrency_holds_on_its_node_and_on_the_next_when_its_node_dies(
    tmp_path: Path, c_guest: Callable[[str], bytes]
) -> None:
    # calls over the limit wait for a slot (and, after the move, for a worker's start) rather
    # than answer 429/503: what is measured is how many run, not how many are refused
    with cluster(tmp_path, nodes=2, TENSORWASM_QUEUE_WAIT_MS="20000") as c:
        victim, survivor = c.node("node-2"), c.node("node-1")
        key = _tenant_on(c, victim.address, c_guest("span.c"))
        log, killed = asyncio.run(_callers_around(c, key, lambda: c.kill(victim.name)))
        before = [x for x in log if x.sent < killed and x.status == 200]
        after = [x for x in log if x.sent >= killed]
        # while affine: every call on its node, never more than LIMIT at once, and it reached LIMIT
        assert before and {x.node for x in before} == {victim.address}
        assert peak([x.span for x in before if x.span]) == LIMIT
        # after the kill: served by the survivor alone, within the bound, and the limit holds there
        moved = [x for x in after if x.status == 200]
        assert moved and {x.node for x in moved} == {survivor.address}
        assert min(x.sent for x in moved) - killed <= MOVE_BOUND_S
        assert peak([x.span for x in moved if x.span]) == LIMIT
        # nor more than LIMIT across both nodes, by the guests' clocks: the calls the dead node was
        # running died with it (none of them answered 200)
        assert peak([x.span for x in log if x.span]) == LIMIT
        # what the client saw: a call its node died under (nginx's 502, or an answer cut short);
        # never a 429 (the calls over the limit waited)
        outcomes = Counter((x.status, x.code) for x in log if x.sent >= killed - 1)
        assert set(outcomes) <= {(200, ""), (502, "node_unavailable"), (0, "cut"), (503, "no_capacity")}, outcomes
        first = min(x.sent for x in moved) - killed
        print(f"\n{CALLERS} callers of a tenant of max_concurrency {LIMIT}: peak {LIMIT} on node-2, then on node-1 "
              f"{first:.2f} s after node-2's kill; outcomes from 1 s before the kill {dict(outcomes)}")


def test_a_drained_node_finishes_its_calls_while_the_next_node_takes_the_new_ones(
    tmp_path: Path, c_guest: Callable[[str], bytes]
) -> None:
    with cluster(tmp_path, nodes=2, TENSORWASM_QUEUE_WAIT_MS="20000") as c:
        drained, survivor = c.node("node-2"), c.node("node-1")
        key = _tenant_on(c, drained.address, c_guest("span.c"))
        log, at = asyncio.run(_callers_around(c, key, lambda: c.drain(drained.name)))
        on_drained = [x for x in log if x.status == 200 and x.node == drained.address]
        moved = [x for x in log if x.sent >= at and x.status == 200 and x.node == survivor.address]
        # the drained node answered the calls it held (some of them after the drain began) ...
        assert on_drained and max(x.span[1] for x in on_drained if x.span) / 1e9 > time.time() - (time.monotonic() - at)
        # ... and the next node took the new ones, within the bound, each node within the limit
        assert moved and min(x.sent for x in moved) - at <= MOVE_BOUND_S
        assert peak([x.span for x in on_drained if x.span]) == LIMIT and peak([x.span for x in moved if x.span]) == LIMIT
        # for that moment the tenant may run up to twice its limit, once per node (documented)
        assert peak([x.span for x in log if x.span]) <= 2 * LIMIT
        outcomes = Counter((x.status, x.code) for x in log if x.sent >= at - 1)
        assert set(outcomes) <= {(200, ""), (502, "node_unavailable"), (503, "no_capacity")}, outcomes
        first = min(x.sent for x in moved) - at
        print(f"\n{CALLERS} callers of a tenant of max_concurrency {LIMIT}: node-2 drained, node-1 served "
              f"{first:.2f} s later; peak across both {peak([x.span for x in log if x.span])}; outcomes from 1 s before {dict(outcomes)}")
