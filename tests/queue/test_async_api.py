"""Async invocations through the HTTP API on real workers: submit, idempotency, quota, output,
cancel, listing, retention, and the restart/lease rules of the queue (both databases)."""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from datetime import datetime, timedelta

import httpx
from sqlalchemy import delete

from app.db.migrate import upgrade
from app.db.models import OUTPUT_SLICE, Invocation, utcnow
from app.db.repositories.invocations import InvocationRepository
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


async def test_an_output_of_several_slices_is_stored_and_read_back_whole(client: httpx.AsyncClient, platform) -> None:
    """An output is stored in slices of OUTPUT_SLICE bytes and answered from them in order, its
    length up front; it counts against the tenant's storage and goes with its record."""
    _, key = await new_tenant(client)
    await deploy(client, key, "echo", wat("echo"))
    body = os.urandom(2 * OUTPUT_SLICE + 12345)
    inv = (await submit(client, key, "echo", body)).json()["id"]
    await wait_status(client, key, inv, "succeeded")
    out = await client.get(f"/v1/invocations/{inv}/output", headers=key)
    assert out.status_code == 200 and out.headers["content-length"] == str(len(body)) and out.content == body
    async with platform.sessionmaker() as s:
        assert (await s.get(Invocation, inv)).output_bytes == len(body)
        assert await InvocationRepository(s).output_slice(inv, 3) is None  # three slices, the last one short
        assert len(await InvocationRepository(s).output_slice(inv, 2) or b"") == 12345
    assert (await client.get("/v1/usage", headers=key)).json()["stored_async_bytes"] == len(body)
    async with platform.sessionmaker() as s:
        await s.execute(delete(Invocation).where(Invocation.id == inv))  # as the sweep deletes records
        await s.commit()
        assert await InvocationRepository(s).output_slice(inv, 0) is None  # the slices went with the record


async def test_guest_error_output_and_status(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "exit3", wat("exit3"))
    inv = (await submit(client, key, "exit3")).json()["id"]
    rec = await wait_status(client, key, inv, "guest_error")
    assert rec["exit_code"] == 3 and rec["stderr_tail"] == "something went wrong\n"
    # the output route answers what a synchronous call that ended so answers
    out = await client.get(f"/v1/invocations/{inv}/output", headers=key)
    sync = await client.post("/v1/functions/exit3/invoke", headers=key)
    assert out.status_code == sync.status_code == 500
    assert out.json()["error"] == {**sync.json()["error"], "message": out.json()["error"]["message"]}
    assert out.json()["error"]["code"] == "guest_error" and out.json()["error"]["exit_code"] == 3
    assert out.json()["error"]["stderr_tail"] == "something went wrong\n"
    assert out.headers["x-invocation-status"] == "guest_error" and out.headers["x-invocation-id"] == inv
    # ... and with any=true, whatever stdout it stored
    out = await client.get(f"/v1/invocations/{inv}/output", params={"any": "true"}, headers=key)
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
    assert out.status_code == 409 and out.json()["error"]["code"] == "cancelled" and out.headers["x-invocation-status"] == "cancelled"
    out = await client.get(f"/v1/invocations/{running}/output?any=1", headers=key)
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
        assert row.output_bytes is None and row.input is None and row.status == "succeeded"
        assert await InvocationRepository(s).output_slice(inv, 0) is None
    r = await client.get(f"/v1/invocations/{inv}/output", headers=key)
    assert r.status_code == 410


async def test_a_timed_out_invocation_answers_504_as_a_sync_call(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client, timeout_ms=300)
    await deploy(client, key, "loop", wat("loop"))
    inv = (await submit(client, key, "loop")).json()["id"]
    await wait_status(client, key, inv, "timeout")
    out = await client.get(f"/v1/invocations/{inv}/output", headers=key)
    sync = await client.post("/v1/functions/loop/invoke", headers=key)
    assert out.status_code == sync.status_code == 504
    assert out.json()["error"]["code"] == sync.json()["error"]["code"] == "timeout"
    assert out.headers["x-invocation-status"] == "timeout"


async def test_a_failed_invocation_answers_its_failure_after_the_retention(client: httpx.AsyncClient, platform) -> None:
    """How it ended stays known once the output is gone; only `any=true` asks for the output."""
    _, key = await new_tenant(client)
    await deploy(client, key, "exit3", wat("exit3"))
    inv = (await submit(client, key, "exit3")).json()["id"]
    await wait_status(client, key, inv, "guest_error")
    real = platform.queue.clock
    platform.queue.clock = lambda: real() + timedelta(seconds=platform.settings.output_retention_s + 1)
    try:
        assert (await client.get(f"/v1/invocations/{inv}/output", headers=key)).status_code == 500
        r = await client.get(f"/v1/invocations/{inv}/output?any=true", headers=key)
        assert r.status_code == 410 and r.json()["error"]["code"] == "expired"
    finally:
        platform.queue.clock = real


async def test_backlog_and_running_gauges(tmp_path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def gauges(text: str) -> dict[str, float]:
        names = ("tensorwasm_async_backlog", "tensorwasm_async_running")
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in names}

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
