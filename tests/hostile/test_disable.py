"""Disabling a tenant stops its queued async work on every node: queued invocations end
`cancelled` in the transaction that disables it, claims skip disabled tenants, and what was
running may finish; re-enabling brings nothing back. Deleting a tenant deletes its queued work
(docs/operations.md, "Disabled tenants")."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import httpx
import wasmtime

from app.db.repositories.invocations import InvocationRepository
from app.services.tenants import DISABLED_REASON
from tests.helpers import ADMIN, deploy, new_tenant, submit, until, wait_status, wat

# spins for 200 ms of the monotonic clock, then returns
_SLOW = """(module
  (import "wasi_snapshot_preview1" "clock_time_get" (func $clock (param i32 i64 i32) (result i32)))
  (memory (export "memory") 1)
  (func $now (result i64) (drop (call $clock (i32.const 1) (i64.const 1) (i32.const 0))) (i64.load (i32.const 0)))
  (func (export "_start") (local $end i64)
    (local.set $end (i64.add (call $now) (i64.const 200000000)))
    (loop $l (br_if $l (i64.lt_u (call $now) (local.get $end))))))"""


async def _records(platform: Any, tenant_id: str) -> list[Any]:
    """The tenant's invocations, read from the database (its keys are refused while disabled)."""
    async with platform.sessionmaker() as session:
        return list(await InvocationRepository(session, tenant_id).list(None, 100))


async def test_queued_work_of_a_disabled_tenant_never_starts(client: httpx.AsyncClient, platform: Any) -> None:
    tid, key = await new_tenant(client, max_concurrency=1, timeout_ms=20_000)
    assert (await deploy(client, key, "slow", bytes(wasmtime.wat2wasm(_SLOW)))).status_code == 201
    ids = [(await submit(client, key, "slow")).json()["id"] for _ in range(20)]
    await wait_status(client, key, ids[1], "succeeded")  # two ran, one at a time

    r = await client.patch(f"/v1/admin/tenants/{tid}", json={"disabled": True}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["disabled"] is True
    acknowledged = datetime.now(UTC)

    async def settled() -> list[Any]:
        while True:
            rows = await _records(platform, tid)
            if all(row.status not in ("queued", "running") for row in rows):
                return rows
            await asyncio.sleep(0.05)

    rows = await asyncio.wait_for(settled(), 30)
    assert len(rows) == 20
    started = [row for row in rows if row.started_at is not None]
    # nothing started after the acknowledgement; at most the one running then (max_concurrency 1)
    # besides those that had ended
    assert all(row.started_at < acknowledged for row in started)
    ended_before = [row for row in started if row.ended_at is not None and row.ended_at < acknowledged]
    assert len(ended_before) >= 2 and len(started) <= len(ended_before) + 1
    assert all(row.status == "succeeded" for row in started)
    cancelled = [row for row in rows if row.started_at is None]
    assert cancelled and all(row.status == "cancelled" and row.error == DISABLED_REASON for row in cancelled)
    assert all(row.input is None for row in cancelled)  # their inputs deleted with them

    # re-enabled: what was cancelled stays so; new work runs (FIFO per tenant: it would have come
    # after any that were still queued)
    r = await client.patch(f"/v1/admin/tenants/{tid}", json={"disabled": False}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["disabled"] is False
    fresh = (await submit(client, key, "slow")).json()["id"]
    assert (await wait_status(client, key, fresh, "succeeded"))["status"] == "succeeded"
    again = {row.id: row.status for row in await _records(platform, tid)}
    assert all(again[row.id] == "cancelled" for row in cancelled)


async def test_a_claim_skips_a_disabled_tenant(client: httpx.AsyncClient, platform: Any) -> None:
    """Queued rows of a tenant disabled by any means (here: in the database, as another node's
    admin call would leave them before its cancel) are never claimed."""
    from sqlalchemy import update

    from app.db.models import Tenant

    tid, key = await new_tenant(client, max_concurrency=1, timeout_ms=20_000)
    assert (await deploy(client, key, "loop", wat("loop"))).status_code == 201
    assert (await deploy(client, key, "noop", wat("noop"))).status_code == 201
    running = (await submit(client, key, "loop")).json()["id"]
    await wait_status(client, key, running, "running")
    queued = (await submit(client, key, "noop")).json()["id"]
    async with platform.sessionmaker() as session:
        await session.execute(update(Tenant).where(Tenant.id == tid).values(disabled=True))
        await session.commit()
    platform.queue_runner.stop_local(running)  # its slot frees: the runner looks again
    await until(lambda: running not in platform.queue_runner.running, "the running call ended")
    for _ in range(3):
        platform.queue_runner.wake()
        await asyncio.sleep(platform.settings.queue_poll_s * 2)
    (row,) = [r for r in await _records(platform, tid) if r.id == queued]
    assert row.status == "queued" and row.started_at is None
    assert (await client.delete(f"/v1/admin/tenants/{tid}", headers=ADMIN)).status_code == 204


async def test_deleting_a_tenant_deletes_its_queued_work(client: httpx.AsyncClient, platform: Any) -> None:
    tid, key = await new_tenant(client, max_concurrency=1, timeout_ms=1000)
    assert (await deploy(client, key, "loop", wat("loop"))).status_code == 201
    running = (await submit(client, key, "loop")).json()["id"]
    await wait_status(client, key, running, "running")
    for _ in range(5):
        assert (await submit(client, key, "loop")).status_code == 202
    before = platform.queue_runner.started_count
    assert (await client.delete(f"/v1/admin/tenants/{tid}", headers=ADMIN)).status_code == 204
    assert await _records(platform, tid) == []
    await until(lambda: running not in platform.queue_runner.running, "the running call ended at its timeout")
    for _ in range(3):
        platform.queue_runner.wake()
        await asyncio.sleep(platform.settings.queue_poll_s * 2)
    assert platform.queue_runner.started_count == before  # none of the five started
