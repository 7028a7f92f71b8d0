"""The queue across node deaths and across nodes, on real `tensorwasm serve` processes."""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from app.db.session import sync_url
from app.observability.phases import PUBLISH_S
from app.settings import Settings
from tests.helpers import ADMIN, Node, fresh_database, fresh_postgres_database, wat


def setup_tenant(node: Node, **quota: int) -> tuple[str, dict[str, str]]:
    with httpx.Client(base_url=node.url, timeout=30) as c:
        name = f"q-{uuid.uuid4().hex[:10]}"
        tid = c.post("/v1/admin/tenants", json={"name": name, "quota": quota}, headers=ADMIN).json()["id"]
        key = {"Authorization": f"Bearer {c.post(f'/v1/admin/tenants/{tid}/api-keys', headers=ADMIN).json()['key']}"}
        for fn in ("echo", "write_then_spin"):
            r = c.put(f"/v1/functions/{fn}", content=wat(fn), headers={**key, "Content-Type": "application/wasm"})
            assert r.status_code == 201, r.text
    return name, key


def wait_for(node: Node, key: dict, inv: str, *statuses: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        rec = httpx.get(f"{node.url}/v1/invocations/{inv}", headers=key, timeout=10).json()
        if rec["status"] in statuses:
            return rec
        assert time.monotonic() < deadline, rec
        time.sleep(0.1)


def test_kill_9_then_restart_runs_queued_and_interrupts_running_with_no_attempts_left(tmp_path: Path) -> None:
    url, drop = fresh_database(tmp_path)
    data = tmp_path / "data"
    node = Node(url, data).start()
    try:
        _, key = setup_tenant(node, max_concurrency=1, timeout_ms=5_000)

        def submit(fn: str, body: bytes = b"") -> httpx.Response:
            return httpx.post(f"{node.url}/v1/functions/{fn}/invocations", content=body, headers=key, timeout=10)

        r = httpx.put(f"{node.url}/v1/functions/write_then_spin", params={"max_attempts": 1}, content=wat("write_then_spin"),
                      headers={**key, "Content-Type": "application/wasm"}, timeout=30)
        assert r.status_code == 200 and r.json()["max_attempts"] == 1  # never run again: it ends interrupted
        running = submit("write_then_spin").json()["id"]
        wait_for(node, key, running, "running")
        queued = {submit("echo", f"job {i}".encode()).json()["id"]: f"job {i}".encode() for i in range(3)}
        for inv in queued:  # the tenant's one slot is taken: these wait
            assert httpx.get(f"{node.url}/v1/invocations/{inv}", headers=key).json()["status"] == "queued"
        node.kill()

        node = Node(url, data).start()  # same database, same data dir: the same node
        rec = wait_for(node, key, running, "interrupted")
        assert "no attempts are left" in rec["error"] and rec["ended_at"] is not None and rec["attempt"] == 1
        for inv, body in queued.items():
            wait_for(node, key, inv, "succeeded")
            out = httpx.get(f"{node.url}/v1/invocations/{inv}/output", headers=key)
            assert out.status_code == 200 and out.content == body and out.headers["x-invocation-status"] == "succeeded"
        out = httpx.get(f"{node.url}/v1/invocations/{running}/output", headers=key)
        assert out.status_code == 500 and out.json()["error"]["code"] == "interrupted" and out.headers["x-invocation-status"] == "interrupted"
        out = httpx.get(f"{node.url}/v1/invocations/{running}/output", params={"any": "true"}, headers=key)
        assert out.status_code == 200 and out.headers["x-invocation-status"] == "interrupted"
    finally:
        node.stop()
        drop()


def _executed(node: Node, tenant: str) -> float:
    """Invocations this node ran for the tenant, from its Prometheus counter."""
    total = 0.0
    for line in httpx.get(f"{node.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("tensorwasm_invocations_total{") and f'tenant="{tenant}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.skipif(
    not os.environ.get("TENSORWASM_TEST_DATABASE_URL"),
    reason="several nodes share only PostgreSQL; set TENSORWASM_TEST_DATABASE_URL to run this",
)
def test_two_nodes_on_postgres_run_each_invocation_once(tmp_path: Path) -> None:
    url, drop = fresh_postgres_database(os.environ["TENSORWASM_TEST_DATABASE_URL"])
    a = b = None
    try:
        a = Node(url, tmp_path / "a").start()
        b = Node(url, tmp_path / "b").start()
        name, key = setup_tenant(a, max_concurrency=8, timeout_ms=60_000)
        n = 40
        ids = {}
        for i in range(n):  # submitted through both nodes; either may claim any of them
            node = (a, b)[i % 2]
            r = httpx.post(f"{node.url}/v1/functions/echo/invocations", content=f"#{i}".encode(), headers=key, timeout=10)
            assert r.status_code == 202, r.text
            ids[r.json()["id"]] = f"#{i}".encode()
        for inv, body in ids.items():
            wait_for(a, key, inv, "succeeded")
            assert httpx.get(f"{b.url}/v1/invocations/{inv}/output", headers=key).content == body
        # each ran exactly once: the two nodes' execution counters add up to the submissions (a
        # front publishes its counts once a second: read until every front has, or too many show)
        deadline = time.monotonic() + 10 * PUBLISH_S
        while (executed := _executed(a, name) + _executed(b, name)) < n and time.monotonic() < deadline:
            time.sleep(PUBLISH_S / 4)
        assert executed == n
        engine = create_engine(sync_url(url))
        with engine.connect() as c:
            claims = Counter(row[0] for row in c.execute(text("SELECT claimed_by FROM invocations WHERE mode = 'async'")))
        engine.dispose()
        assert sum(claims.values()) == n and len(claims) == 2, claims  # both nodes took work
        # a cancel through the node that does not run the call reaches the one that does
        spin = httpx.post(f"{a.url}/v1/functions/write_then_spin/invocations", headers=key, timeout=10).json()["id"]
        wait_for(a, key, spin, "running")
        engine = create_engine(sync_url(url))
        with engine.connect() as c:
            runner = c.execute(text("SELECT claimed_by FROM invocations WHERE id = :i"), {"i": spin}).scalar()
        engine.dispose()
        other = b if runner == Settings(data_dir=tmp_path / "a").resolved_node_id else a
        r = httpx.post(f"{other.url}/v1/invocations/{spin}/cancel", headers=key, timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    finally:
        for node in (a, b):
            if node is not None:
                node.stop()
        drop()
