"""Error envelopes the routes share: a database busy past its lock wait is 503 with Retry-After."""

from __future__ import annotations

import sqlite3
import time

import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.helpers import ADMIN, new_tenant


async def test_a_write_that_waits_out_sqlites_lock_is_503_and_the_retry_lands(client: httpx.AsyncClient, database_url: str) -> None:
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite":
        pytest.skip("SQLite's database-wide write lock; PostgreSQL's passing failures are covered in tests/db/test_errors.py")
    tid, _ = await new_tenant(client)
    holder = sqlite3.connect(str(url.database), timeout=0)
    try:
        holder.execute("BEGIN IMMEDIATE")  # another process mid-write, stopped there
        t0 = time.monotonic()
        r = await client.patch(f"/v1/admin/tenants/{tid}/quota", headers=ADMIN, json={"max_concurrency": 3})
        waited = time.monotonic() - t0
    finally:
        holder.rollback()
        holder.close()
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "unavailable"
    assert "retry" in r.json()["error"]["message"]
    assert r.headers["Retry-After"] == "1"
    assert waited >= 4, waited  # it waited for the lock (busy timeout 5 s) before giving up
    assert (await client.get(f"/v1/admin/tenants/{tid}/quota", headers=ADMIN)).json()["max_concurrency"] != 3  # nothing half-written
    r = await client.patch(f"/v1/admin/tenants/{tid}/quota", headers=ADMIN, json={"max_concurrency": 3})
    assert r.status_code == 200 and r.json()["max_concurrency"] == 3
