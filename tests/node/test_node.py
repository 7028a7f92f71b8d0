"""A real node of two fronts (`TENSORWASM_PROCESSES=2`): limits hold node-wide, a killed front
loses only its own call, metrics add up over both fronts, a killed supervisor leaves nothing
(how a call is sent through one front: tests/node/helpers.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from app.observability.phase_metrics import CALLS, SECONDS
from app.observability.phases import PUBLISH_S, Phase
from tests.helpers import ADMIN, ADMIN_TOKEN, compile_bomb, deploy, descendants, new_tenant, process_alive, server_process, wat
from tests.node.helpers import WriteLock, both_fronts, http, only, pinned, samples, tenant_busy, until, write_lock


@pytest.fixture(scope="module")
def node(server_database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    data = tmp_path_factory.mktemp("node")
    # a long cache TTL: a front would serve stale keys and functions unless told of changes
    env = {"TENSORWASM_PROCESSES": "2", "TENSORWASM_MAX_WORKERS": "6", "TENSORWASM_QUEUE_WAIT_MS": "300", "TENSORWASM_CACHE_TTL_S": "600"}
    with server_process(data, server_database_url, env={"TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN, **env}) as server:
        yield server.proc, server.url


async def test_concurrency_holds_across_fronts(node: tuple[Any, str]) -> None:
    proc, base = node
    a, b = await both_fronts(proc)
    async with http(base) as admin:
        tid, key = await new_tenant(admin, max_concurrency=1, timeout_ms=15_000)
        assert (await deploy(admin, key, "loop", wat("loop"))).status_code == 201
        async with http(base) as via_a, http(base) as via_b:
            async with only(a, [a, b]):
                first = asyncio.create_task(via_a.post("/v1/functions/loop/invoke", headers=key))
                await until(lambda: tenant_busy(admin, tid), "the first call to run")
            async with only(b, [a, b]):
                second = await via_b.post("/v1/functions/loop/invoke", headers=key)
                usage = (await admin.get("/v1/usage", headers=key)).json()
            assert second.status_code == 429, second.text
            assert second.json()["error"]["code"] == "rate_limited"
            assert "concurrency limit (1" in second.json()["error"]["message"]
            assert second.headers["Retry-After"]
            assert usage["running"] == 1 and usage["workers"] == 1
            busy = [w for w in (await admin.get("/v1/admin/workers", headers=ADMIN)).json() if w["tenant_id"] == tid]
            assert [w["state"] for w in busy] == ["busy"]
            first.cancel()


async def test_a_caller_that_goes_away_stops_its_guest_and_the_worker_stays(node: tuple[Any, str]) -> None:
    """A disconnect mid-call (plain or streamed) stops the guest at once and frees the tenant's
    slot; the worker is not replaced, so disconnects cost the node no context starts."""
    proc, base = node
    await both_fronts(proc)
    async with http(base) as admin:
        tid, key = await new_tenant(admin, max_concurrency=1, timeout_ms=30_000)
        for fn in ("loop", "echo", "write_then_spin"):
            assert (await deploy(admin, key, fn, wat(fn))).status_code == 201
        assert (await admin.post("/v1/functions/echo/invoke", headers=key, content=b"warm")).status_code == 200
        mine = [w for w in (await admin.get("/v1/admin/workers", headers=ADMIN)).json() if w["tenant_id"] == tid]
        assert len(mine) == 1
        before = samples((await admin.get("/metrics")).text, "tensorwasm_worker_restarts_total")

        async def slot_free() -> bool:
            return (await admin.get("/v1/usage", headers=key)).json()["running"] == 0

        # a body larger than the transport's high-water mark leaves the front's reading paused
        # once read: the front must still see the client close
        for body in (b"", b"x" * 200_000):
            async with http(base) as caller:
                call = asyncio.create_task(caller.post("/v1/functions/loop/invoke", headers=key, content=body))
                await until(lambda: tenant_busy(admin, tid), "the endless call to run")
                t0 = time.monotonic()
                call.cancel()  # the client goes away
                await until(slot_free, "the stopped call to give its slot back", limit_s=10)
                assert time.monotonic() - t0 < 5  # stopped, not run out to its 30 s limit

        async with http(base) as caller:
            async with caller.stream("POST", "/v1/functions/write_then_spin/invoke", headers={**key, "Accept": "text/event-stream"}) as s:
                assert s.status_code == 200
                async for chunk in s.aiter_text():
                    if "event: output" in chunk:
                        break  # leaves mid-stream: the response is closed here
        await until(slot_free, "the stopped stream to give its slot back", limit_s=10)

        r = await admin.post("/v1/functions/echo/invoke", headers=key, content=b"after")
        assert r.status_code == 200 and r.text == "after"
        now = [w for w in (await admin.get("/v1/admin/workers", headers=ADMIN)).json() if w["tenant_id"] == tid]
        assert [(w["id"], w["pid"]) for w in now] == [(w["id"], w["pid"]) for w in mine]

        async def counted_all() -> bool:  # a worker counts a run after its reply, off the caller's path
            workers = (await admin.get("/v1/admin/workers", headers=ADMIN)).json()
            n = next(w["invocations"] for w in workers if w["tenant_id"] == tid)
            assert n <= 5, n
            return bool(n == 5)

        await until(counted_all, "the worker to count its five runs (warm, the stopped three, the last)", limit_s=10)
        assert samples((await admin.get("/metrics")).text, "tensorwasm_worker_restarts_total") == before


async def test_a_killed_front_loses_only_its_own_call(node: tuple[Any, str], c_guest: Callable[[str], bytes]) -> None:
    proc, base = node
    a, b = await both_fronts(proc)
    spin = c_guest("spin.c")
    async with http(base) as admin:
        doomed_tid, doomed = await new_tenant(admin, timeout_ms=60_000)
        assert (await deploy(admin, doomed, "loop", wat("loop"))).status_code == 201
        assert (await deploy(admin, doomed, "echo", wat("echo"))).status_code == 201
        other_tid, other = await new_tenant(admin)
        assert (await deploy(admin, other, "spin", spin)).status_code == 201
        async with http(base) as via_a, http(base) as via_b:
            async with only(a, [a, b]):
                lost = asyncio.create_task(via_a.post("/v1/functions/loop/invoke", headers=doomed))
                victim = await until(lambda: tenant_busy(admin, doomed_tid), "the doomed call to run")
            async with only(b, [a, b]):
                kept = asyncio.create_task(via_b.post("/v1/functions/spin/invoke", headers=other, content=b"2000"))
                await until(lambda: tenant_busy(admin, other_tid), "the other call to run")
                os.kill(a, signal.SIGKILL)  # front a dies with the doomed call in flight
            with pytest.raises(httpx.HTTPError):
                await lost
            r = await kept
            assert r.status_code == 200 and r.text == "done"  # through front b, untouched

        async def replaced() -> bool:
            workers = (await admin.get("/v1/admin/workers", headers=ADMIN)).json()
            return not any(w["id"] == victim["id"] for w in workers) and not process_alive(victim["pid"])

        await until(replaced, "the doomed call's worker to be replaced")
        new_a, new_b = await both_fronts(proc)  # the supervisor started a new front
        assert a not in (new_a, new_b) and b in (new_a, new_b)
        r = await admin.post("/v1/functions/echo/invoke", headers=doomed, content=b"again")
        assert r.status_code == 200 and r.text == "again"

        async def idle() -> bool:  # the echo call's lease goes back just after its answer
            return (await admin.get("/v1/usage", headers=doomed)).json()["running"] == 0

        await until(idle, "the doomed tenant's count of running calls to drop to 0", limit_s=10)  # nothing leaked from the killed front
        metrics = (await admin.get("/metrics")).text
        assert samples(metrics, "tensorwasm_worker_restarts_total", reason="cancelled") >= 1


async def test_admin_changes_reach_every_front_at_once(node: tuple[Any, str]) -> None:
    """An admin call returns once every front dropped what it changed: the very next request,
    on the other front, sees it (no front is stopped here, as in production)."""
    proc, base = node
    fronts = list(await both_fronts(proc))
    async with http(base) as admin:
        tid, key = await new_tenant(admin)
    async with pinned(base, fronts[0], fronts) as a, pinned(base, fronts[1], fronts) as b:
        assert (await deploy(a, key, "f", wat("echo"))).status_code == 201
        r = await b.post("/v1/functions/f/invoke", headers=key, content=b"v1")
        assert r.status_code == 200 and r.text == "v1"  # front b now caches the key and the function

        assert (await deploy(a, key, "f", wat("exit3"))).status_code == 200  # a new version, through a
        r = await b.post("/v1/functions/f/invoke", headers=key, content=b"v2")
        assert r.status_code == 500 and r.json()["error"]["exit_code"] == 3

        assert (await b.get("/v1/usage", headers=key)).json()["quota"]["max_concurrency"] == 4
        r = await a.put(f"/v1/admin/tenants/{tid}/quota", headers=ADMIN, json={"max_concurrency": 2})
        assert r.status_code == 200, r.text
        assert (await b.get("/v1/usage", headers=key)).json()["quota"]["max_concurrency"] == 2

        key_id = (await a.get(f"/v1/admin/tenants/{tid}/api-keys", headers=ADMIN)).json()[0]["id"]
        assert (await a.delete(f"/v1/admin/tenants/{tid}/api-keys/{key_id}", headers=ADMIN)).status_code == 204
        r = await b.post("/v1/functions/f/invoke", headers=key, content=b"v3")
        assert r.status_code == 401


async def test_a_stopped_front_does_not_hold_an_admin_call(node: tuple[Any, str], server_database_url: str) -> None:
    """A front that cannot answer (stopped here) is waited for 2 s at most; it applies the change
    when it runs again."""
    proc, base = node
    a, b = await both_fronts(proc)
    async with http(base) as admin:
        tid, key = await new_tenant(admin)
    # b is stopped outside its own writes (records, lease renewals), which would hold SQLite's lock
    with write_lock(server_database_url) as lock:
        async with only(a, [a, b], lock), http(base) as client:
            t0 = time.monotonic()
            r = await client.patch(f"/v1/admin/tenants/{tid}/quota", headers=ADMIN, json={"max_concurrency": 3})
            took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert 1.5 <= took < 10, took  # waited for the stopped front's answer, then gave up on it
    async with pinned(base, b, [a, b]) as on_b:
        assert (await on_b.get("/v1/usage", headers=key)).json()["quota"]["max_concurrency"] == 3


async def test_a_front_stopped_inside_its_database_write_costs_another_front_a_503_not_a_500(node: tuple[Any, str], server_database_url: str) -> None:
    """SQLite has one write lock for the whole database: a front stopped while it writes its
    batched records keeps it, and a write through the other front gives up after the 5 s lock
    wait. That is a passing failure (503 with Retry-After), and the retry lands once it runs."""
    if make_url(server_database_url).get_backend_name() != "sqlite":
        pytest.skip("SQLite's database-wide write lock; PostgreSQL locks rows")
    proc, base = node
    a, b = await both_fronts(proc)
    async with http(base) as admin:
        tid, key = await new_tenant(admin)
        assert (await deploy(admin, key, "echo", wat("echo"))).status_code == 201
    lock = WriteLock(server_database_url)
    async with pinned(base, b, [a, b]) as on_b, pinned(base, a, [a, b]) as on_a:
        async def calls_on_b() -> None:  # each call's record: b writes a batch every 0.2 s
            while True:
                await on_b.post("/v1/functions/echo/invoke", headers=key, content=b"x")

        load = asyncio.create_task(calls_on_b())
        caught, deadline = False, time.monotonic() + 60
        try:
            while not caught:
                assert time.monotonic() < deadline, "front b was never caught inside a write"
                if lock.held():
                    os.kill(b, signal.SIGSTOP)
                    caught = await lock.held_throughout(0.3)  # still held once b stopped: b holds it
                    if not caught:
                        os.kill(b, signal.SIGCONT)
                await asyncio.sleep(0)
            load.cancel()
            t0 = time.monotonic()
            r = await on_a.patch(f"/v1/admin/tenants/{tid}/quota", headers=ADMIN, json={"max_concurrency": 3})
            waited = time.monotonic() - t0
        finally:
            os.kill(b, signal.SIGCONT)
            lock.close()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await load
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "unavailable" and r.headers["Retry-After"] == "1"
        assert waited >= 4, waited
        r = await on_a.patch(f"/v1/admin/tenants/{tid}/quota", headers=ADMIN, json={"max_concurrency": 3})
        assert r.status_code == 200 and r.json()["max_concurrency"] == 3


async def test_the_supervisor_holds_a_silent_front_to_the_hard_deadline(node: tuple[Any, str]) -> None:
    proc, base = node
    a, b = await both_fronts(proc)
    async with http(base) as admin:
        tid, key = await new_tenant(admin, timeout_ms=500)
        assert (await deploy(admin, key, "loop", wat("loop"))).status_code == 201
        before = samples((await admin.get("/metrics")).text, "tensorwasm_worker_restarts_total", reason="hard_timeout")
        async with http(base) as via_a:
            async with only(a, [a, b]):
                call = asyncio.create_task(via_a.post("/v1/functions/loop/invoke", headers=key))
                victim = await until(lambda: tenant_busy(admin, tid), "the call to run")
            os.kill(a, signal.SIGSTOP)  # front a can neither time the call out nor release it
            try:
                async with only(b, [a, b]):

                    async def killed() -> bool:
                        text = (await admin.get("/metrics")).text
                        return samples(text, "tensorwasm_worker_restarts_total", reason="hard_timeout") > before

                    await until(killed, "the supervisor to take the lease back")

                    async def dead() -> bool:  # SIGKILLed before it was counted, but on a busy host it exits when next scheduled
                        return not process_alive(victim["pid"])

                    await until(dead, "the worker to die", limit_s=5)
            finally:
                os.kill(a, signal.SIGCONT)
            # front a wakes past its own deadline with its worker gone: the call fails as a timeout
            # or a lost worker, whichever the front's loop sees first; its late release is ignored
            r = await call
            assert (r.status_code, r.json()["error"]["code"]) in ((504, "timeout"), (500, "worker_crashed")), r.text
        usage = (await admin.get("/v1/usage", headers=key)).json()
        assert usage["running"] == 0


async def test_a_worker_killed_mid_call_fails_that_call_through_its_front(node: tuple[Any, str]) -> None:
    _, base = node
    async with http(base) as client:
        tid, key = await new_tenant(client, timeout_ms=60_000)
        assert (await deploy(client, key, "loop", wat("loop"))).status_code == 201
        assert (await deploy(client, key, "echo", wat("echo"))).status_code == 201
        call = asyncio.create_task(client.post("/v1/functions/loop/invoke", headers=key))
        busy = await until(lambda: tenant_busy(client, tid), "the call to run")
        os.kill(busy["pid"], signal.SIGKILL)
        r = await call
        assert r.status_code == 500 and r.json()["error"]["code"] == "worker_crashed", r.text
        # the next call runs once a worker is free: a replacement that starts a CUDA context can
        # outlast this node's 300 ms queue wait (and SQLite's lock the other tests' records), a
        # 503 to retry after its Retry-After
        for _ in range(10):
            r = await client.post("/v1/functions/echo/invoke", headers=key, content=b"after")
            if r.status_code != 503:
                break
            assert r.json()["error"]["code"] in ("no_capacity", "unavailable"), r.text
            await asyncio.sleep(float(r.headers["retry-after"]))
        assert r.status_code == 200 and r.text == "after"
        workers = (await client.get("/v1/admin/workers", headers=ADMIN)).json()
        assert busy["id"] not in [w["id"] for w in workers]


async def test_metrics_are_node_wide(node: tuple[Any, str]) -> None:
    proc, base = node
    a, b = await both_fronts(proc)
    async with http(base) as admin:
        tid, key = await new_tenant(admin)
        tenant = next(t["name"] for t in (await admin.get("/v1/admin/tenants", headers=ADMIN)).json() if t["id"] == tid)
        assert (await deploy(admin, key, "echo", wat("echo"))).status_code == 201
        for front, calls in ((a, 3), (b, 4)):
            async with only(front, [a, b]), http(base) as client:
                for _ in range(calls):
                    assert (await client.post("/v1/functions/echo/invoke", headers=key, content=b"x")).status_code == 200

        async def all_seven() -> str | None:
            # a front publishes the counts it holds once a second (and the scraped one at once)
            text = (await admin.get("/metrics")).text
            return text if samples(text, "tensorwasm_invocation_run_seconds_count", tenant=tenant) == 7 else None

        text = await until(all_seven, "both fronts' counts in one scrape", 10)
    assert samples(text, "tensorwasm_invocations_total", tenant=tenant, outcome="succeeded") == 7
    assert samples(text, "tensorwasm_invocation_duration_seconds_count", tenant=tenant) == 7
    # where each call's time went, from both fronts: its wait for a lease and its guest's run
    assert samples(text, "tensorwasm_invocation_wait_seconds_count", tenant=tenant) == 7
    assert samples(text, "tensorwasm_invocation_run_seconds_count", tenant=tenant) == 7
    run_s = samples(text, "tensorwasm_invocation_run_seconds_sum", tenant=tenant)
    assert 0 < run_s < samples(text, "tensorwasm_invocation_duration_seconds_sum", tenant=tenant)
    assert samples(text, "tensorwasm_workers", state="idle") >= 1  # the supervisor's families, in the same scrape
    assert text.count("# TYPE tensorwasm_workers gauge") == 1
    # the stalls of the fronts' loops (summed) and of the supervisor's, each under its own name
    assert samples(text, "tensorwasm_event_loop_lag_seconds_count") > 0
    assert samples(text, "tensorwasm_supervisor_event_loop_lag_seconds_count") > 0
    assert text.count("# TYPE tensorwasm_gc_pause_seconds histogram") == 1
    assert "tensorwasm_supervisor_gc_pause_seconds_bucket" in text
    assert text.count("# TYPE tensorwasm_supervisor_event_loop_lag_seconds histogram") == 1


async def test_the_fronts_phases_add_up_in_one_scrape(node: tuple[Any, str]) -> None:
    proc, base = node
    a, b = await both_fronts(proc)
    calls = f"{CALLS}_total"
    async with http(base) as admin:
        _, key = await new_tenant(admin)
        assert (await deploy(admin, key, "echo", wat("echo"))).status_code == 201
        await asyncio.sleep(PUBLISH_S + 0.5)  # what either front timed before is published
        before = samples((await admin.get("/metrics")).text, calls)
        for front, n in ((a, 3), (b, 4)):
            async with only(front, [a, b]), http(base) as client:
                for _ in range(n):
                    assert (await client.post("/v1/functions/echo/invoke", headers=key, content=b"x")).status_code == 200

        async def published() -> str | None:  # the front not scraped publishes within PUBLISH_S
            text = (await admin.get("/metrics")).text
            # and the calls' record batch is written a moment after them (record_write)
            written = all(samples(text, f"{SECONDS}_total", phase=p.label) > 0 for p in Phase)
            return text if samples(text, calls) - before >= 7 and written else None

        text = await until(published, "both fronts' calls")
    assert samples(text, calls) - before == 7
    assert [p.label for p in Phase if samples(text, f"{SECONDS}_total", phase=p.label) <= 0] == []
    assert text.count(f"# TYPE {SECONDS}_total counter") == 1


async def test_a_killed_supervisor_leaves_no_process(server_database_url: str, tmp_path: Path) -> None:
    env = {"TENSORWASM_PROCESSES": "2", "TENSORWASM_MAX_WORKERS": "2"}
    with server_process(tmp_path / "node", server_database_url, env={"TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN, **env}) as server:
        proc, base = server.proc, server.url
        async with http(base) as client:
            tid, key = await new_tenant(client, timeout_ms=600_000)
            assert (await deploy(client, key, "loop", wat("loop"))).status_code == 201
            call = asyncio.create_task(client.post("/v1/functions/loop/invoke", headers=key))
            busy = await until(lambda: tenant_busy(client, tid), "the guest to run")
            front_pids = await both_fronts(proc)
            tree = descendants(proc.pid)
            assert set(front_pids) <= tree and busy["pid"] in tree
            assert len(tree) >= 4  # two fronts, the fork server and the busy worker, at least
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            with pytest.raises(httpx.HTTPError):
                await call

    async def gone() -> bool:
        return not [p for p in tree if process_alive(p)]

    await until(gone, "every process of the node to die", limit_s=10)


async def test_compile_slots_are_node_wide(server_database_url: str, tmp_path: Path) -> None:
    """With one compile slot per node, a deploy through one front waits for another tenant's
    compile running through the other front (each front's own limiter would let it pass)."""
    env = {"TENSORWASM_PROCESSES": "2", "TENSORWASM_COMPILE_CONCURRENCY": "1", "TENSORWASM_COMPILE_TIMEOUT_S": "4"}
    with server_process(tmp_path / "node", server_database_url, env={"TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN, **env}) as server:
        a, b = await both_fronts(server.proc)
        async with http(server.url) as admin:
            _, heavy = await new_tenant(admin)
            _, light = await new_tenant(admin)
        async with pinned(server.url, a, [a, b]) as via_a, pinned(server.url, b, [a, b]) as via_b:
            bomb = asyncio.create_task(deploy(via_a, heavy, "bomb", compile_bomb(1500, 8000)))
            await asyncio.sleep(0.5)  # the bomb holds the node's one slot (it compiles for 2-4 s)
            assert not bomb.done()
            t0 = time.monotonic()
            small = await deploy(via_b, light, "echo", wat("echo"))
            waited = time.monotonic() - t0
            assert small.status_code == 201
            # it waited for the bomb's compile to give the slot back (alone it takes ~0.05 s);
            # the bomb's own reply may come later, after its post-compile writes
            assert waited > 0.5, waited
            assert (await bomb).status_code in (201, 422)  # compiled, or over the time limit


async def test_async_stream_and_records_through_either_front(node: tuple[Any, str]) -> None:
    """Async work submitted or cancelled through either front (one drains the queue), a stream
    through either front, and a call's record read at once through the other front."""
    proc, base = node
    a, b = await both_fronts(proc)
    async with http(base) as admin:
        _, key = await new_tenant(admin, timeout_ms=60_000)
        for fn in ("echo", "write_then_spin", "utf8_lines"):
            assert (await deploy(admin, key, fn, wat(fn))).status_code == 201
    async with pinned(base, a, [a, b]) as via_a, pinned(base, b, [a, b]) as via_b:
        for client in (via_a, via_b):
            r = await client.post("/v1/functions/echo/invocations", content=b"queued", headers=key)
            assert r.status_code == 202, r.text
            inv = r.json()["id"]

            async def status(i: str, want: str, c: httpx.AsyncClient = client) -> bool:
                record = (await c.get(f"/v1/invocations/{i}", headers=key)).json()
                assert record["status"] in (want, "queued", "running"), record  # it ended otherwise: say how
                return bool(record["status"] == want)

            await until(lambda i=inv: status(i, "succeeded"), "the queued call to run")
            assert (await client.get(f"/v1/invocations/{inv}/output", headers=key)).content == b"queued"
            # submitted once the first has run: two calls claimed together start in no set order
            # (each reads its function first), and one that spins for a minute could go first
            spin = (await client.post("/v1/functions/write_then_spin/invocations", headers=key)).json()["id"]
            await until(lambda i=spin: status(i, "running"), "the spinning call to start")
            t0 = time.monotonic()
            r = await client.post(f"/v1/invocations/{spin}/cancel", headers=key)
            assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
            assert time.monotonic() - t0 < 2.0  # stopped at once, not at the next lease renewal

            async with client.stream("POST", "/v1/functions/utf8_lines/invoke", headers={**key, "Accept": "text/event-stream"}) as s:
                assert s.status_code == 200
                text = "".join([chunk async for chunk in s.aiter_text()])
            assert "event: output" in text and '"status": "succeeded"' in text
        r = await via_a.post("/v1/functions/echo/invoke", content=b"sync", headers=key)
        call_id = r.headers["X-Invocation-Id"]
        r = await via_b.get(f"/v1/invocations/{call_id}", headers=key)  # front a holds it in its batch
        assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text

