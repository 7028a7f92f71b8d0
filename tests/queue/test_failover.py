"""At-least-once async work: what a lost node held is queued again and run elsewhere, up to the
function's max_attempts, then ends `interrupted`; the record names each attempt and its node."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import httpx

from app.db.models import Invocation, Node, utcnow
from app.db.repositories.invocations import InvocationRepository
from tests.helpers import deploy, new_tenant, submit, wait_status, wat


async def _running(platform: Any, tid: str, node: str, *, attempt: int, max_attempts: int, lease_s: float = 3600,
                   cancel: bool = False) -> str:
    """A claim of `node` as its runner would have written it, its input kept."""
    inv_id, now = uuid.uuid4().hex, utcnow()
    async with platform.sessionmaker() as s:
        s.add(Invocation(id=inv_id, tenant_id=tid, function="echo", version=1, mode="async", status="running",
                         created_at=now, started_at=now, input=b"payload", claimed_by=node,
                         lease_expires_at=now + timedelta(seconds=lease_s), attempt=attempt, max_attempts=max_attempts,
                         cancel_requested=cancel))
        await s.commit()
    return inv_id


async def _dead_node(platform: Any) -> str:
    """A node that last beat an hour ago."""
    node, then = f"dead-{uuid.uuid4().hex[:8]}", utcnow() - timedelta(hours=1)
    async with platform.sessionmaker() as s:
        s.add(Node(id=node, host="gone", started_at=then, last_seen=then))
        await s.commit()
    return node


async def test_a_dead_nodes_work_runs_again_elsewhere(client: httpx.AsyncClient, platform: Any) -> None:
    tid, key = await new_tenant(client)
    await deploy(client, key, "echo", wat("echo"))
    dead = await _dead_node(platform)
    # its lease still runs for an hour: the missing heartbeats alone tell the node is gone
    inv = await _running(platform, tid, dead, attempt=1, max_attempts=3)
    rec = await wait_status(client, key, inv, "succeeded", "interrupted", timeout_s=15)
    assert rec["status"] == "succeeded" and rec["attempt"] == 2 and rec["max_attempts"] == 3
    assert rec["node"] == platform.queue_runner.node_id
    (lost,) = rec["lost_attempts"]
    assert lost["attempt"] == 1 and lost["node"] == dead and lost["lost_at"] >= lost["started_at"]
    out = await client.get(f"/v1/invocations/{inv}/output", headers=key)
    assert out.status_code == 200 and out.content == b"payload"  # the input was kept for the retry


async def test_an_expired_lease_is_lost_too(client: httpx.AsyncClient, platform: Any) -> None:
    """A claim whose node never heartbeat (or whose runner stalled) is found by its lease."""
    tid, key = await new_tenant(client)
    await deploy(client, key, "echo", wat("echo"))
    inv = await _running(platform, tid, "no-heartbeat-node", attempt=1, max_attempts=2, lease_s=-1)
    rec = await wait_status(client, key, inv, "succeeded", "interrupted", timeout_s=15)
    assert (rec["status"], rec["attempt"], [a["node"] for a in rec["lost_attempts"]]) == ("succeeded", 2, ["no-heartbeat-node"])


async def test_spent_attempts_end_interrupted_and_a_cancel_is_kept(client: httpx.AsyncClient, platform: Any) -> None:
    tid, key = await new_tenant(client)
    await deploy(client, key, "echo", wat("echo"))
    dead = await _dead_node(platform)
    spent = await _running(platform, tid, dead, attempt=2, max_attempts=2)
    cancelled = await _running(platform, tid, dead, attempt=1, max_attempts=3, cancel=True)
    rec = await wait_status(client, key, spent, "interrupted", "succeeded", timeout_s=15)
    assert rec["status"] == "interrupted" and rec["attempt"] == 2 and len(rec["lost_attempts"]) == 1
    assert rec["error"] == f"its node ({dead}) stopped before it finished, in attempt 2 of 2: no attempts are left, it is not run again"
    out = await client.get(f"/v1/invocations/{spent}/output", headers=key)
    assert out.status_code == 500 and out.json()["error"]["code"] == "interrupted" and out.headers["x-invocation-status"] == "interrupted"
    out = await client.get(f"/v1/invocations/{spent}/output?any=true", headers=key)
    assert out.status_code == 200 and out.content == b""
    rec = await wait_status(client, key, cancelled, "cancelled", "succeeded", timeout_s=15)
    assert rec["status"] == "cancelled" and "its cancel was asked" in rec["error"]


async def test_a_restarted_node_hands_back_its_own_claims(client: httpx.AsyncClient, platform: Any) -> None:
    """What a node does first at its start (and last at a clean stop) with its own claims."""
    tid, key = await new_tenant(client)
    await deploy(client, key, "echo", wat("echo"))
    me = platform.queue_runner.node_id
    once = await _running(platform, tid, me, attempt=1, max_attempts=1)
    again = await _running(platform, tid, me, attempt=1, max_attempts=3)
    async with platform.sessionmaker() as s:
        done = await InvocationRepository(s).recover(utcnow(), node_id=me)
        await s.commit()
    assert (done.requeued, done.interrupted, done.cancelled) >= (1, 1, 0)
    assert (await wait_status(client, key, once, "interrupted"))["attempt"] == 1
    rec = await wait_status(client, key, again, "succeeded", timeout_s=15)
    assert rec["attempt"] == 2 and rec["lost_attempts"][0]["node"] == me


async def test_max_attempts_is_a_function_setting(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    r = await deploy(client, key, "echo", wat("echo"))
    assert r.status_code == 201 and r.json()["max_attempts"] == 3  # the default
    r = await deploy(client, key, "echo", wat("echo"), max_attempts=1)
    assert r.status_code == 200 and r.json()["max_attempts"] == 1
    for bad in (0, 11):
        r = await deploy(client, key, "echo", wat("echo"), max_attempts=bad)
        assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
    inv = (await submit(client, key, "echo", b"x")).json()
    assert (inv["attempt"], inv["max_attempts"]) == (0, 1)  # taken at the submit; 0: not yet run
    rec = await wait_status(client, key, inv["id"], "succeeded")
    assert (rec["attempt"], rec["node"], rec["lost_attempts"]) == (1, rec["node"], []) and rec["node"]
    sync = await client.post("/v1/functions/echo/invoke", content=b"y", headers=key)
    assert sync.status_code == 200
    listed = (await client.get("/v1/invocations", params={"function": "echo"}, headers=key)).json()["items"]
    assert {(i["mode"], i["attempt"]) for i in listed} == {("sync", 1), ("async", 1)}
