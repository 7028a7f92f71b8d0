"""Async invocations through the HTTP API on real workers: submit, idempotency, quota, output,
cancel, listing, retention, and the restart/lease rules of the queue (both databases)."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from datetime import datetime, timedelta

import httpx

from app.db.migrate import upgrade
from app.db.models import Invocation, utcnow
from tests.helpers import ADMIN, deploy, fresh_database, make_settings, new_tenant, running_app, submit, wait_status, wat


async def test_submit_runs_and_stores_output(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "echo", wat("echo"), content_type="text/plain; charset=utf-8")
    r = await submit(client, key, "echo", b"hello async")
    assert r.status_code == 202
    rec = r.json()
    inv = rec["id"]
    assert rec["status"] == "queued" and rec["mode"] == "async" and rec["started_at"] is None
    assert r.headers["location"] == f"/v1/invocations/{inv}" and r.headers["x-invocation-id"] == inv
    rec = await wait_status(client, key, inv, "succeeded")
    assert rec["exit_code"] == 0 and rec["ended_at"] is not None and rec["started_at"] is not None
    out = await client.get(f"/v1/invocations/{inv}/output", headers=key)
    assert out.status_code == 200 and out.content == b"hello async"
    assert out.headers["content-type"] == "text/plain; charset=utf-8"
    assert out.headers["x-invocation-status"] == "succeeded"


async def test_guest_error_output_and_status(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "exit3", wat("exit3"))
    inv = (await submit(client, key, "exit3")).json()["id"]
    rec = await wait_status(client, key, inv, "guest_error")
    assert rec["exit_code"] == 3 and rec["stderr_tail"] == "something went wrong\n"
    out = await client.get(f"/v1/invocations/{inv}/output", headers=key)
    assert out.status_code == 200 and out.content == b"partial output\n"
    assert out.headers["x-invocation-status"] == "guest_error"


async def test_unknown_function_is_404_and_other_tenant_cannot_see(client: httpx.AsyncClient) -> None:
    _, a = await new_tenant(client)
    _, b = await new_tenant(client)
    r = await submit(client, a, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    await deploy(client, a, "echo", wat("echo"))
    inv = (await submit(client, a, "echo", b"x")).json()["id"]
    for path in (f"/v1/invocations/{inv}", f"/v1/invocations/{inv}/output"):
        assert (await client.get(path, headers=b)).status_code == 404
    r = await client.post(f"/v1/invocations/{inv}/cancel", headers=b)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


async def test_idempotency_key_returns_same_invocation_per_tenant(client: httpx.AsyncClient) -> None:
    _, a = await new_tenant(client)
    _, b = await new_tenant(client)
    for key in (a, b):
        await deploy(client, key, "echo", wat("echo"))
    k = {"Idempotency-Key": f"order-{uuid.uuid4().hex}"}
    first = await submit(client, a, "echo", b"once", k)
    again = await submit(client, a, "echo", b"twice", k)
    other = await submit(client, b, "echo", b"b", k)
    assert first.status_code == again.status_code == other.status_code == 202
    assert first.json()["id"] == again.json()["id"] != other.json()["id"]
    await wait_status(client, a, first.json()["id"], "succeeded")
    assert (await client.get(f"/v1/invocations/{first.json()['id']}/output", headers=a)).content == b"once"
    page = (await client.get("/v1/invocations", headers=a)).json()["items"]
    assert len(page) == 1


async def test_idempotency_key_expires_after_window(client: httpx.AsyncClient, platform) -> None:
    _, a = await new_tenant(client)
    await deploy(client, a, "echo", wat("echo"))
    k = {"Idempotency-Key": "daily"}
    first = (await submit(client, a, "echo", b"1", k)).json()["id"]
    real = platform.queue.clock
    platform.queue.clock = lambda: real() + timedelta(days=1, seconds=1)
    try:
        second = (await submit(client, a, "echo", b"2", k)).json()["id"]
    finally:
        platform.queue.clock = real
    assert second != first


async def test_max_queued_is_429_and_usage_counts(client: httpx.AsyncClient) -> None:
    tid, key = await new_tenant(client, max_concurrency=1, max_queued=2, timeout_ms=20_000)
    await deploy(client, key, "loop", wat("loop"))
    running = (await submit(client, key, "loop")).json()["id"]
    await wait_status(client, key, running, "running")
    queued = [(await submit(client, key, "loop")).json()["id"] for _ in range(2)]
    r = await submit(client, key, "loop")
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"]
    usage = (await client.get("/v1/usage", headers=key)).json()
    assert usage["quota"]["max_queued"] == 2 and usage["async_queued"] == 2 and usage["async_running"] == 1
    # not yet started: output 409, and a queued cancel never runs
    r = await client.get(f"/v1/invocations/{queued[0]}/output", headers=key)
    assert r.status_code == 409 and r.json()["error"]["code"] == "not_finished"
    for inv in queued:
        r = await client.post(f"/v1/invocations/{inv}/cancel", headers=key)
        assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["started_at"] is None
    # room again
    quota = {"max_queued": 0, "max_concurrency": 1, "timeout_ms": 20_000}
    assert (await client.put(f"/v1/admin/tenants/{tid}/quota", json=quota, headers=ADMIN)).status_code == 200
    r = await submit(client, key, "loop")
    assert r.status_code == 429
    # a running one: stopped, cancelled, its worker replaced; the tenant's next call works
    r = await client.post(f"/v1/invocations/{running}/cancel", headers=key)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    r = await client.post(f"/v1/invocations/{running}/cancel", headers=key)
    assert r.status_code == 409 and r.json()["error"]["code"] == "already_finished"
    out = await client.get(f"/v1/invocations/{running}/output", headers=key)
    assert out.status_code == 200 and out.headers["x-invocation-status"] == "cancelled"
    await deploy(client, key, "echo", wat("echo"))
    r = await client.post("/v1/functions/echo/invoke", content=b"alive", headers=key)
    assert r.status_code == 200 and r.content == b"alive"


async def test_queued_work_is_fifo_and_within_concurrency(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client, max_concurrency=1)
    await deploy(client, key, "echo", wat("echo"))
    ids = [(await submit(client, key, "echo", str(i).encode())).json()["id"] for i in range(6)]
    recs = [await wait_status(client, key, i, "succeeded") for i in ids]
    starts = [r["started_at"] for r in recs]
    assert starts == sorted(starts)
    for a, b in itertools.pairwise(recs):  # one at a time: each started after the previous ended
        assert b["started_at"] >= a["ended_at"]


async def test_sync_call_has_no_output_and_status_filter_and_cursor(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "echo", wat("echo"))
    await deploy(client, key, "exit3", wat("exit3"))
    sync = (await client.post("/v1/functions/echo/invoke", content=b"s", headers=key)).headers["x-invocation-id"]
    r = await client.get(f"/v1/invocations/{sync}/output", headers=key)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    ids = [(await submit(client, key, "echo", b"x")).json()["id"] for _ in range(4)]
    bad = (await submit(client, key, "exit3")).json()["id"]
    for i in ids:
        await wait_status(client, key, i, "succeeded")
    await wait_status(client, key, bad, "guest_error")
    seen, cursor = [], None
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = (await client.get("/v1/invocations", params=params, headers=key)).json()
        seen += [i["id"] for i in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == sorted([sync, bad, *ids]) and len(seen) == len(set(seen))
    failed = (await client.get("/v1/invocations", params={"status": "guest_error"}, headers=key)).json()["items"]
    assert [i["id"] for i in failed] == [bad]
    modes = {i["id"]: i["mode"] for i in (await client.get("/v1/invocations", headers=key)).json()["items"]}
    assert modes[sync] == "sync" and modes[bad] == "async"
    r = await client.get("/v1/invocations", params={"status": "bogus"}, headers=key)
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error"
    r = await client.get("/v1/invocations", params={"cursor": "not-a-cursor"}, headers=key)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_cursor"


async def test_output_expires_after_retention_and_sweep(client: httpx.AsyncClient, platform) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "echo", wat("echo"))
    inv = (await submit(client, key, "echo", b"keep me")).json()["id"]
    await wait_status(client, key, inv, "succeeded")

    def later() -> datetime:
        return utcnow() + timedelta(seconds=platform.settings.output_retention_s + 1)

    real_q, real_r = platform.queue.clock, platform.queue_runner.clock
    platform.queue.clock = later
    try:
        r = await client.get(f"/v1/invocations/{inv}/output", headers=key)
        assert r.status_code == 410 and r.json()["error"]["code"] == "expired"
        platform.queue_runner.clock = later
        assert await platform.queue_runner.sweep() >= 1
    finally:
        platform.queue.clock, platform.queue_runner.clock = real_q, real_r
    async with platform.sessionmaker() as s:
        row = await s.get(Invocation, inv)
        assert row.output is None and row.input is None and row.status == "succeeded"
    r = await client.get(f"/v1/invocations/{inv}/output", headers=key)
    assert r.status_code == 410


async def test_stale_claims_end_interrupted_never_rerun(client: httpx.AsyncClient, platform) -> None:
    """At start a node ends its own running claims `interrupted`; any node ends claims whose
    lease ran out (their node died) the same way."""
    tid, key = await new_tenant(client)
    await deploy(client, key, "echo", wat("echo"))
    now = utcnow()
    mine, other = uuid.uuid4().hex, uuid.uuid4().hex
    async with platform.sessionmaker() as s:
        for inv_id, node, lease in ((mine, platform.queue_runner.node_id, now + timedelta(hours=1)), (other, "dead-node", now - timedelta(seconds=1))):
            s.add(Invocation(id=inv_id, tenant_id=tid, function="echo", version=1, mode="async", status="running",
                             created_at=now, started_at=now, input=b"x", claimed_by=node, lease_expires_at=lease))
        await s.commit()
    rec = await wait_status(client, key, other, "interrupted", timeout_s=10)  # found by the lease loop
    assert "not re-run" in rec["error"]
    from app.db.repositories.invocations import InvocationRepository

    async with platform.sessionmaker() as s:  # what a restart of this node does first
        assert await InvocationRepository(s).interrupt(utcnow(), node_id=platform.queue_runner.node_id) == 1
        await s.commit()
    rec = await wait_status(client, key, mine, "interrupted")
    out = await client.get(f"/v1/invocations/{mine}/output", headers=key)
    assert out.status_code == 200 and out.content == b"" and out.headers["x-invocation-status"] == "interrupted"


async def test_backlog_and_running_gauges(tmp_path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def gauges(text: str) -> dict[str, float]:
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith("tensorwasm_async_")}

    # its own database (the backlog counts every node's queued work), a lease check (and so a
    # backlog count) every 0.1 s
    url, drop = fresh_database(tmp_path)
    upgrade(url)
    async with running_app(make_settings(url, tmp_path / "data", queue_lease_s=0.3)) as (client, _):
        assert gauges((await client.get("/metrics")).text) == {"tensorwasm_async_backlog": 0, "tensorwasm_async_running": 0}
        _, key = await new_tenant(client, max_concurrency=1, timeout_ms=60_000)
        await deploy(client, key, "loop", wat("loop"))
        ids = [(await submit(client, key, "loop")).json()["id"] for _ in range(3)]
        await wait_status(client, key, ids[0], "running")
        deadline = asyncio.get_running_loop().time() + 30
        while (seen := gauges((await client.get("/metrics")).text)) != {"tensorwasm_async_backlog": 2, "tensorwasm_async_running": 1}:
            assert asyncio.get_running_loop().time() < deadline, seen  # one runs (max_concurrency 1), two wait
            await asyncio.sleep(0.05)
        for inv in reversed(ids):
            assert (await client.post(f"/v1/invocations/{inv}/cancel", headers=key)).status_code == 200
    drop()
