"""Handoffs on a real node of two fronts: a busy tenant's lease goes from call to call in its front
without a release and a grant between them, and nothing the lease-per-call node guarantees gives
way: the tenant's concurrency and rate hold, and another tenant's call that waits for a worker
slot gets one while the busy tenant still has calls waiting (its leases are recalled)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers import ADMIN, ADMIN_TOKEN, deploy, new_tenant, server_process, wat
from tests.node.helpers import both_fronts, http, only, pinned, samples


@pytest.fixture(scope="module")
def node(server_database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    env = {
        "TENSORWASM_PROCESSES": "2", "TENSORWASM_MAX_WORKERS": "2", "TENSORWASM_RESERVED_WORKERS": "0",
        "TENSORWASM_QUEUE_WAIT_MS": "5000", "TENSORWASM_LEASE_HANDOFF_RUNS": "1000",
    }
    with server_process(tmp_path_factory.mktemp("handoffs"), server_database_url, env={"TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN, **env}) as server:
        yield server.proc, server.url


async def _counts(client: httpx.AsyncClient) -> tuple[float, float]:
    text = (await client.get("/metrics")).text
    leases = samples(text, "tensorwasm_leases_total", held="true") + samples(text, "tensorwasm_leases_total", held="false")
    return leases, samples(text, "tensorwasm_lease_handoffs_total")


async def _calls(client: httpx.AsyncClient, key: dict[str, str], fn: str, n: int) -> list[httpx.Response]:
    return await asyncio.gather(*(client.post(f"/v1/functions/{fn}/invoke", headers=key) for _ in range(n)))


async def test_a_busy_tenants_calls_in_one_front_pass_its_lease_on(node: tuple[Any, str]) -> None:
    """max_concurrency 1: waves of 5 calls at once through one front (4 waiting: within the
    bound a front passes leases on under) run one after another on one worker, each after the
    first of its wave on a lease passed on from the call before (a call runs ~20 ms, so the
    others are waiting by then)."""
    proc, base = node
    a, b = await both_fronts(proc)
    async with http(base) as admin:
        tid, key = await new_tenant(admin, max_concurrency=1, requests_per_second=1000)
        assert (await deploy(admin, key, "busy", wat("busy"))).status_code == 201
        leases0, handoffs0 = await _counts(admin)
        async with pinned(base, a, [a, b]) as warm:
            assert (await warm.post("/v1/functions/busy/invoke", headers=key)).status_code == 200
        many = httpx.Limits(max_keepalive_connections=5, max_connections=5)
        replies: list[httpx.Response] = []
        async with httpx.AsyncClient(base_url=base, timeout=60, limits=many) as on_a:
            async with only(a, [a, b]):  # 5 connections, all accepted by front a
                for _ in range(4):
                    replies += await _calls(on_a, key, "busy", 5)
        assert [r.status_code for r in replies] == [200] * 20
        leases1, handoffs1 = await _counts(admin)
        assert handoffs1 - handoffs0 >= 12, (handoffs0, handoffs1)
        assert leases1 - leases0 + handoffs1 - handoffs0 == 21  # every call: a grant or a handoff
        workers = [w for w in (await admin.get("/v1/admin/workers", headers=ADMIN)).json() if w["tenant_id"] == tid]
        assert len(workers) == 1 and workers[0]["invocations"] == 21  # the limit held: one worker did all
        assert (await admin.get("/v1/usage", headers=key)).json()["running"] == 0


async def test_handoffs_keep_the_tenants_rate(node: tuple[Any, str]) -> None:
    """Every call is admitted against the rate when it asks, handed a lease or not: a burst gets
    no more than the bucket holds (2 s of rate) plus what refills meanwhile."""
    proc, base = node
    a, b = await both_fronts(proc)
    rate = 5
    async with http(base) as admin:
        _, key = await new_tenant(admin, max_concurrency=1, requests_per_second=rate)
        assert (await deploy(admin, key, "busy", wat("busy"))).status_code == 201
        _, handoffs0 = await _counts(admin)
        many = httpx.Limits(max_keepalive_connections=5, max_connections=5)
        t0 = time.monotonic()
        async with httpx.AsyncClient(base_url=base, timeout=60, limits=many) as on_a:
            async with only(a, [a, b]):  # one front: the admitted calls wait there for each other
                replies = await _calls(on_a, key, "busy", 40)
        elapsed = time.monotonic() - t0
        _, handoffs1 = await _counts(admin)
    codes = [r.status_code for r in replies]
    assert set(codes) == {200, 429}, codes
    assert all(r.json()["error"]["code"] == "rate_limited" for r in replies if r.status_code == 429)
    assert rate <= codes.count(200) <= 2 * rate + rate * elapsed + 1, (codes, elapsed)
    assert handoffs1 > handoffs0  # the admitted calls did queue, and passed leases on


async def test_a_tenant_waiting_for_a_slot_gets_one_while_a_busy_tenant_passes_leases_on(node: tuple[Any, str]) -> None:
    """Two worker slots, none reserved: tenant t holds both, and front a passes t's leases on
    (up to 1000 calls each) while t's calls wait there (6 callers, 2 running, 4 waiting). Tenant u's call waits for a slot: t's leases are
    recalled, so u runs while t still has calls waiting, not once t's flood is over."""
    proc, base = node
    a, b = await both_fronts(proc)
    async with http(base) as admin:
        _, key_t = await new_tenant(admin, max_concurrency=2, requests_per_second=10_000, timeout_ms=5000)
        _, key_u = await new_tenant(admin, max_concurrency=1, requests_per_second=100)
        assert (await deploy(admin, key_t, "busy", wat("busy"))).status_code == 201  # ~20 ms a call
        assert (await deploy(admin, key_u, "echo", wat("echo"))).status_code == 201
        stop = asyncio.Event()
        codes: list[int] = []

        async def flood(client: httpx.AsyncClient) -> None:
            while not stop.is_set():
                r = await client.post("/v1/functions/busy/invoke", headers=key_t)
                codes.append(r.status_code)

        _, handoffs0 = await _counts(admin)
        many = httpx.Limits(max_keepalive_connections=6, max_connections=6)
        async with httpx.AsyncClient(base_url=base, timeout=60, limits=many) as on_a:
            async with only(a, [a, b]):
                await asyncio.gather(*(on_a.get("/healthz") for _ in range(6)))  # 6 connections on front a
            floods = [asyncio.create_task(flood(on_a)) for _ in range(6)]
            try:
                await asyncio.sleep(1.0)
                assert (await _counts(admin))[1] > handoffs0, "the flood passes leases on"
                async with pinned(base, b, [a, b]) as on_b:
                    t0 = time.monotonic()
                    r = await on_b.post("/v1/functions/echo/invoke", headers=key_u, content=b"u")
                    waited = time.monotonic() - t0
                assert r.status_code == 200 and r.text == "u", r.text
                assert not any(f.done() for f in floods)  # t's flood ran all along
            finally:
                stop.set()
                await asyncio.gather(*floods, return_exceptions=True)
    assert codes and set(codes) <= {200, 429, 503}, set(codes)
    assert codes.count(200) > len(codes) // 2
    assert waited < 4.5, waited  # within u's queue wait: a worker start, not the flood's end
