"""The noisy neighbour, with real workers: one tenant floods the node with more long calls than
it has workers; other tenants' calls made meanwhile are all served while the flood still waits."""

from __future__ import annotations

import asyncio
import time

import httpx

from app.worker.handle import WorkerState
from tests.helpers import deploy, new_tenant, wat


async def _until(check, what: str, bound_s: float = 120) -> None:  # type: ignore[no-untyped-def]
    """Poll a condition; the bound only keeps a broken build from hanging the suite."""
    deadline = time.monotonic() + bound_s
    while not check():
        assert time.monotonic() < deadline, f"never saw: {what}"
        await asyncio.sleep(0.02)


async def test_a_quiet_tenant_is_served_while_another_floods(app_factory, c_guest) -> None:
    async with app_factory(max_workers=4, warm_spares=1, reserved_workers=1, queue_wait_ms=600_000, queue_limit=64) as (client, platform):
        s = platform.scheduler
        flood_id, flood = await new_tenant(client, max_concurrency=16, timeout_ms=10_000)
        _, quiet = await new_tenant(client)
        _, newcomer = await new_tenant(client)
        await deploy(client, flood, "spin", c_guest("spin.c"))
        for key in (quiet, newcomer):
            await deploy(client, key, "echo", wat("echo"))

        def post(key: dict[str, str], name: str, body: bytes) -> asyncio.Task[httpx.Response]:
            return asyncio.create_task(client.post(f"/v1/functions/{name}/invoke", content=body, headers=key))

        # 16 calls on 4 workers, 3.5 s each: the flood waits ~15 s, past a busy host's quiet calls
        # and the worker start one of them needs
        calls = [post(flood, "spin", b"3500") for _ in range(16)]
        # the flood runs its share on 3 workers, has calls waiting, and the 4th worker is a spare
        await _until(
            lambda: s.fair.running(flood_id) == s.fair.share == 3
            and len(s.fair.queue(flood_id)) > 0
            and sum(w.tenant_id == flood_id and w.state == WorkerState.BUSY for w in s.workers) == 3
            and any(w.state == WorkerState.SPARE for w in s.workers),
            "the flood at its share with a spare ready",
        )

        served: list[tuple[int, int]] = []  # (status, flood calls still waiting when it returned)
        for i in range(5):
            r = await post(quiet, "echo", f"q{i}".encode())
            assert r.content == f"q{i}".encode()
            served.append((r.status_code, len(s.fair.queue(flood_id))))
            assert s.fair.running(flood_id) <= s.fair.share
        # a second quiet tenant finds no spare: it evicts the first one's idle worker
        evicted = s.restarts["evicted"]
        r = await post(newcomer, "echo", b"n")
        served.append((r.status_code, len(s.fair.queue(flood_id))))
        assert r.content == b"n" and s.restarts["evicted"] == evicted + 1

        assert [status for status, _ in served] == [200] * 6
        assert all(waiting > 0 for _, waiting in served), f"a quiet call waited for the flood to drain: {served}"
        results = await asyncio.gather(*calls)
        assert [r.status_code for r in results] == [200] * 16  # the flood is slowed, not refused
        assert s.fair.held == 0 and s.fair.queued() == 0


async def test_a_tenant_past_its_share_gets_429_and_the_node_503_when_full(app_factory, c_guest) -> None:
    async with app_factory(max_workers=2, warm_spares=1, reserved_workers=1, queue_wait_ms=200) as (client, platform):
        s = platform.scheduler
        a_id, a = await new_tenant(client, max_concurrency=4)
        _, b = await new_tenant(client)
        _, c = await new_tenant(client)
        await deploy(client, a, "spin", c_guest("spin.c"))
        for key in (b, c):
            await deploy(client, key, "spin", c_guest("spin.c"))
        first = asyncio.create_task(client.post("/v1/functions/spin/invoke", content=b"60000", headers=a))
        await _until(lambda: s.fair.running(a_id) == 1, "a's first call running")
        # a holds its share (1 of 2): its next call waits, then is refused as over its share
        r = await client.post("/v1/functions/spin/invoke", content=b"1", headers=a)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
        assert "share" in r.json()["error"]["message"] and r.headers["retry-after"] == "1"
        assert s.rejections[(s.tenants[a_id].principal.name, "fair_share")] == 1
        # b takes the reserved slot; c then finds every worker busy: 503, not an endless wait
        second = asyncio.create_task(client.post("/v1/functions/spin/invoke", content=b"60000", headers=b))
        await _until(lambda: s.fair.held == 2, "b's call holding the reserved slot")
        r = await client.post("/v1/functions/spin/invoke", content=b"1", headers=c)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_capacity"
        for task in (first, second):  # the callers leave: their slots come back
            task.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        await _until(lambda: s.fair.held == 0, "slots given back")
        r = await client.post("/v1/functions/spin/invoke", content=b"1", headers=c)
        assert r.status_code == 200 and r.content == b"done"
