"""Error envelopes the routes share: a database busy past its lock wait is 503 with Retry-After."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import psycopg
from sqlalchemy.engine import make_url

from tests.helpers import ADMIN, new_tenant


@asynccontextmanager
async def _held(database_url: str, tenant_id: str) -> AsyncIterator[None]:
    """Another connection holds a lock the quota write needs (a front stopped mid-write): SQLite's
    database-wide write lock, or PostgreSQL's lock on the tenant's row."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite":
        holder = sqlite3.connect(str(url.database), timeout=0)
        deadline = time.monotonic() + 10
        while True:  # a write of the app's own may be under way (it runs on this loop): let it end
            try:
                holder.execute("BEGIN IMMEDIATE")
                break
            except sqlite3.OperationalError:
                assert time.monotonic() < deadline, "the app held the database's write lock for 10 s"
                await asyncio.sleep(0.05)
        try:
            yield
        finally:
            holder.rollback()
            holder.close()
        return
    with psycopg.connect(url.set(drivername="postgresql").render_as_string(hide_password=False)) as pg:
        pg.execute("SELECT id FROM tenants WHERE id = %s FOR UPDATE", (tenant_id,))
        yield
        pg.rollback()


async def test_a_write_that_waits_out_the_lock_wait_is_503_and_the_retry_lands(client: httpx.AsyncClient, database_url: str) -> None:
    tid, _ = await new_tenant(client)
    async with _held(database_url, tid):
        t0 = time.monotonic()
        r = await client.patch(f"/v1/admin/tenants/{tid}/quota", headers=ADMIN, json={"max_concurrency": 3})
        waited = time.monotonic() - t0
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "unavailable"
    assert "retry" in r.json()["error"]["message"]
    assert r.headers["Retry-After"] == "1"
    assert waited >= 4, waited  # it waited for the lock (5 s: app/db/session.py) before giving up
    assert (await client.get(f"/v1/admin/tenants/{tid}/quota", headers=ADMIN)).json()["max_concurrency"] != 3  # nothing half-written
    r = await client.patch(f"/v1/admin/tenants/{tid}/quota", headers=ADMIN, json={"max_concurrency": 3})
    assert r.status_code == 200 and r.json()["max_concurrency"] == 3
