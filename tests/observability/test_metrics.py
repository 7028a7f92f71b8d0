from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import update

from app.db.models import Invocation
from app.db.repositories.nodes import NodeRepository
from tests.helpers import ADMIN, deploy, from_address, new_tenant, submit, wait_status, wat


def _samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


async def test_metrics_cover_invocations_http_and_workers(client: httpx.AsyncClient) -> None:
    tid, key = await new_tenant(client)
    tenant = (await client.get(f"/v1/admin/tenants/{tid}", headers={"Authorization": "Bearer test-admin-token"})).json()["name"]
    await deploy(client, key, "echo", wat("echo"))
    await deploy(client, key, "trap", wat("trap"))
    assert (await client.post("/v1/functions/echo/invoke", content=b"x", headers=key)).status_code == 200
    assert (await client.post("/v1/functions/trap/invoke", headers=key)).status_code == 500
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    s = _samples(r.text)
    outcomes = {(x.labels["function"], x.labels["outcome"]): x.value for x in s["tensorwasm_invocations_total"] if x.labels["tenant"] == tenant}
    assert outcomes == {("echo", "succeeded"): 1.0, ("trap", "guest_error"): 1.0}
    routes = {x.labels["route"] for x in s["tensorwasm_http_requests_total"]}
    assert "/v1/functions/{name}/invoke" in routes and "/v1/functions/{name}" in routes
    assert not any(tenant in r or "echo" in r for r in routes), "routes are templates, never raw paths"
    assert sum(x.value for x in s["tensorwasm_workers"]) >= 1
    assert any(x.labels["tenant"] == tenant for x in s["tensorwasm_gpu_memory_cap_bytes"])
    assert s["tensorwasm_cold_start_seconds_count"][0].value >= 1
    starts = s["tensorwasm_worker_start_seconds_count"][0].value
    assert starts >= 1 and s["tensorwasm_worker_start_seconds_sum"][0].value > 0  # the spare the tenant bound
    assert {x.labels["result"] for x in s["tensorwasm_kernel_compile_cache_total"]} == {"hit", "miss"}
    assert "tensorwasm_worker_restarts_total" in s


async def test_rejections_are_counted(client: httpx.AsyncClient) -> None:
    tid, key = await new_tenant(client, requests_per_second=1)
    await deploy(client, key, "noop", wat("noop"))
    codes = [(await client.post("/v1/functions/noop/invoke", headers=key)).status_code for _ in range(4)]
    assert 429 in codes
    s = _samples((await client.get("/metrics")).text)
    assert any(x.labels["reason"] == "rate" and x.value >= 1 for x in s["tensorwasm_rejections_total"])


async def test_request_id_is_echoed(client: httpx.AsyncClient) -> None:
    r = await client.get("/healthz", headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    assert len((await client.get("/healthz")).headers["x-request-id"]) == 16


async def test_metrics_token(app_factory) -> None:
    async with app_factory(metrics_token="scrape-secret") as (client, _):
        assert (await client.get("/metrics")).status_code == 401
        assert (await client.get("/metrics", headers={"Authorization": "Bearer nope"})).status_code == 401
        assert (await client.get("/metrics", headers={"Authorization": "Bearer scrape-secret"})).status_code == 200


@pytest.mark.parametrize("given", ["x" * 129, "a b", "\u00e9t\u00e9", "id\x7f", ""])
async def test_a_request_id_that_is_not_short_and_plain_is_replaced(client: httpx.AsyncClient, given: str) -> None:
    r = await client.get("/healthz", headers=[(b"x-request-id", given.encode("utf-8"))])
    echoed = r.headers["x-request-id"]
    assert echoed != given and len(echoed) == 16


async def test_metrics_off_loopback_need_a_token(client: httpx.AsyncClient, app_factory) -> None:
    async with from_address(client, "203.0.113.9") as remote:
        r = await remote.get("/metrics")
        assert r.status_code == 401 and "TENSORWASM_METRICS_TOKEN" in r.json()["error"]["message"]
        assert (await remote.get("/metrics", headers=ADMIN)).status_code == 200
    assert (await client.get("/metrics")).status_code == 200  # loopback
    async with app_factory(metrics_public=True) as (public, _), from_address(public, "203.0.113.9") as remote:
        assert (await remote.get("/metrics")).status_code == 200


async def test_metrics_tokens_are_guessed_no_faster_than_keys(client: httpx.AsyncClient, platform: Any) -> None:
    burst = platform.settings.auth_failure_burst
    async with from_address(client, "203.0.113.10") as guesser:
        codes = [(await guesser.get("/metrics", headers={"Authorization": f"Bearer guess-{i}"})).status_code for i in range(burst + 1)]
    assert codes[:-1] == [401] * burst and codes[-1] == 429


async def _scrape(client: httpx.AsyncClient, name: str) -> list[Any]:
    return _samples((await client.get("/metrics")).text).get(name, [])


async def _claimed_by(platform: Any, client: httpx.AsyncClient, key: dict[str, str], inv: str, node: str) -> None:
    """Once this node runs `inv`, hand its claim to `node`, as if that node held it."""
    await wait_status(client, key, inv, "running")
    async with platform.sessionmaker() as session:
        await session.execute(update(Invocation).where(Invocation.id == inv).values(claimed_by=node))
        await session.commit()


async def test_a_node_exports_its_id_the_nodes_it_sees_and_what_it_recovered(client: httpx.AsyncClient, platform: Any) -> None:
    """tensorwasm_node_info names this node; tensorwasm_nodes_alive counts live heartbeats (not
    a node gone a minute ago); a dead node's running work queued again counts a retry, and its
    last attempt lost counts an interruption, on the node that recovered them."""
    me = platform.settings.resolved_node_id
    assert [s.labels["node_id"] for s in await _scrape(client, "tensorwasm_node_info")] == [me]
    # the database is the session's: this node may have recovered earlier apps' work at its start
    (retries,) = [s.value for s in await _scrape(client, "tensorwasm_async_retries_total")]
    (interrupted,) = [s.value for s in await _scrape(client, "tensorwasm_async_interrupted_total")]
    dead = "node-dead"
    async with platform.sessionmaker() as session:
        await NodeRepository(session).beat(dead, "elsewhere", platform.clock() - timedelta(seconds=60), started=True)
        await session.commit()
    _, key = await new_tenant(client, timeout_ms=60_000)
    assert (await deploy(client, key, "loop", wat("loop"))).status_code == 201
    assert (await deploy(client, key, "once", wat("loop"), max_attempts=1)).status_code == 201
    retried = (await submit(client, key, "loop")).json()["id"]
    lost = (await submit(client, key, "once")).json()["id"]
    for inv in (retried, lost):
        await _claimed_by(platform, client, key, inv, dead)
    assert (await wait_status(client, key, lost, "interrupted"))["attempt"] == 1
    rec = await wait_status(client, key, retried, "running", "queued")
    deadline = time.monotonic() + 30
    while rec["attempt"] < 2:  # queued again, then claimed here
        assert time.monotonic() < deadline, rec
        await asyncio.sleep(0.05)
        rec = (await client.get(f"/v1/invocations/{retried}", headers=key)).json()
    assert [a["node"] for a in rec["lost_attempts"]] == [dead]
    assert [s.value for s in await _scrape(client, "tensorwasm_async_retries_total")] == [retries + 1]
    assert [s.value for s in await _scrape(client, "tensorwasm_async_interrupted_total")] == [interrupted + 1]
    table = (await client.get("/v1/admin/nodes", headers=ADMIN)).json()
    (alive,) = [s.value for s in await _scrape(client, "tensorwasm_nodes_alive")]
    assert 1 <= alive <= len([n for n in table if n["id"] != dead])  # this node counted, node-dead not
    assert (await client.post(f"/v1/invocations/{retried}/cancel", headers=key)).status_code in (200, 202)
