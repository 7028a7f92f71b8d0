"""Held leases on a real node of two fronts: a warm tenant's calls on one front share a lease the
supervisor granted once, and nothing the lease-per-call node guarantees gives way: a call on the
other front gets the worker at once (recall), the tenant's rate holds, an admin change reaches
the held worker.

The hold and idle windows are long here (5 s), so only a recall can end a hold within a test's
bounds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import ADMIN, ADMIN_TOKEN, deploy, new_tenant, server_process, wat
from tests.node.helpers import both_fronts, http, pinned, samples

HOLD_S = 5.0


@pytest.fixture(scope="module")
def node(server_database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    env = {
        "TENSORWASM_PROCESSES": "2", "TENSORWASM_MAX_WORKERS": "4", "TENSORWASM_QUEUE_WAIT_MS": "3000",
        "TENSORWASM_LEASE_HOLD_MS": str(int(HOLD_S * 1000)), "TENSORWASM_LEASE_IDLE_MS": str(int(HOLD_S * 1000)),
    }
    with server_process(tmp_path_factory.mktemp("held"), server_database_url, env={"TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN, **env}) as server:
        yield server.proc, server.url


async def _leases(client: Any) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    return {held: samples(text, "tensorwasm_leases_total", held=held) for held in ("true", "false")}


async def test_a_warm_tenants_calls_on_one_front_share_a_held_lease(node: tuple[Any, str]) -> None:
    proc, base = node
    a, b = await both_fronts(proc)
    async with http(base) as admin:
        tid, key = await new_tenant(admin, requests_per_second=1000)
        assert (await deploy(admin, key, "echo", wat("echo"))).status_code == 201
        before = await _leases(admin)
        async with pinned(base, a, [a, b]) as on_a:
            for i in range(20):
                r = await on_a.post("/v1/functions/echo/invoke", headers=key, content=f"call {i}".encode())
                assert r.status_code == 200 and r.text == f"call {i}", r.text
        after = await _leases(admin)
        assert after["true"] - before["true"] == 1, (before, after)  # one grant carried all 20 calls
        assert after["false"] == before["false"]
        usage = (await admin.get("/v1/usage", headers=key)).json()
        assert usage["running"] == 1 and usage["workers"] == 1  # the held lease counts as running


async def test_a_call_on_another_front_recalls_the_held_lease(node: tuple[Any, str]) -> None:
    """max_concurrency 1: the lease front a holds is the tenant's one slot; front b's call gets
    it back at once, not after the hold (nor a 429 after the queue wait)."""
    proc, base = node
    a, b = await both_fronts(proc)
    async with http(base) as admin:
        tid, key = await new_tenant(admin, max_concurrency=1, requests_per_second=1000)
        assert (await deploy(admin, key, "echo", wat("echo"))).status_code == 201
        async with pinned(base, a, [a, b]) as on_a, pinned(base, b, [a, b]) as on_b:
            assert (await on_a.post("/v1/functions/echo/invoke", headers=key, content=b"a")).text == "a"
            t0 = time.monotonic()
            r = await on_b.post("/v1/functions/echo/invoke", headers=key, content=b"b")
            assert r.status_code == 200 and r.text == "b", r.text
            assert time.monotonic() - t0 < HOLD_S / 2
            # and back: front b now holds the slot; front a's next call recalls it from b
            r = await on_a.post("/v1/functions/echo/invoke", headers=key, content=b"a2")
            assert r.status_code == 200 and r.text == "a2", r.text
        workers = [w for w in (await admin.get("/v1/admin/workers", headers=ADMIN)).json() if w["tenant_id"] == tid]
        assert len(workers) == 1 and workers[0]["invocations"] >= 2  # one worker served both fronts


async def test_held_leases_keep_the_tenants_rate(node: tuple[Any, str]) -> None:
    """Calls on a held lease are paid at its grant, from the upper half of the burst: a burst
    still gets no more than the bucket holds (2 s of rate) plus what refills meanwhile."""
    proc, base = node
    a, b = await both_fronts(proc)
    rate = 5
    async with http(base) as admin:
        _, key = await new_tenant(admin, requests_per_second=rate)
        assert (await deploy(admin, key, "echo", wat("echo"))).status_code == 201
        codes: list[int] = []
        async with pinned(base, a, [a, b]) as on_a, pinned(base, b, [a, b]) as on_b:
            t0 = time.monotonic()
            for i in range(40):
                r = await (on_a if i % 4 else on_b).post("/v1/functions/echo/invoke", headers=key, content=b"x")
                codes.append(r.status_code)
                if r.status_code == 429:
                    assert r.json()["error"]["code"] == "rate_limited" and r.headers["Retry-After"]
            elapsed = time.monotonic() - t0
    assert set(codes) <= {200, 429}
    # at most the burst and its refill; at least half the burst (runs a held lease still had
    # paid for when the test ended go back to the rate only at its release)
    assert rate <= codes.count(200) <= 2 * rate + rate * elapsed + 1, (codes, elapsed)
    assert codes.count(429) > 0


async def test_a_tenant_change_reaches_a_held_worker_at_once(node: tuple[Any, str]) -> None:
    """A quota change retires the tenant's workers; the one a front holds goes back at once
    (recalled), not at the end of its hold."""
    proc, base = node
    a, b = await both_fronts(proc)
    async with http(base) as admin:
        tid, key = await new_tenant(admin, requests_per_second=1000)
        assert (await deploy(admin, key, "echo", wat("echo"))).status_code == 201
        async with pinned(base, a, [a, b]) as on_a:
            assert (await on_a.post("/v1/functions/echo/invoke", headers=key, content=b"x")).status_code == 200
        held = [w["id"] for w in (await admin.get("/v1/admin/workers", headers=ADMIN)).json() if w["tenant_id"] == tid]
        assert len(held) == 1
        t0 = time.monotonic()
        r = await admin.put(f"/v1/admin/tenants/{tid}/quota", headers=ADMIN, json={"max_concurrency": 3})
        assert r.status_code == 200, r.text
        while any(w["id"] == held[0] for w in (await admin.get("/v1/admin/workers", headers=ADMIN)).json()):
            assert time.monotonic() - t0 < HOLD_S / 2, "the held worker outlived the change"
            await asyncio.sleep(0.05)
        r = await admin.post("/v1/functions/echo/invoke", headers=key, content=b"after")
        assert r.status_code == 200 and r.text == "after"
