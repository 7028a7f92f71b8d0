"""The warm call path on a real node of three fronts (docs/architecture.md, "The call path"): a
tenant's calls go from any front straight to its workers, and every limit still holds node-wide,
counted where it can be by the guests themselves; the supervisor is asked nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import wasmtime

from tests.helpers import ADMIN, ADMIN_TOKEN, GUESTS, deploy, new_tenant, process_alive, server_process, wat
from tests.node.helpers import both_fronts, http, only, pinned, samples, tenant_busy, until

FRONTS = 3


@pytest.fixture(scope="module")
def node(server_database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    env = {"TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN, "TENSORWASM_PROCESSES": str(FRONTS), "TENSORWASM_MAX_WORKERS": "6",
           "TENSORWASM_QUEUE_WAIT_MS": "2000", "TENSORWASM_CACHE_TTL_S": "600"}
    with server_process(tmp_path_factory.mktemp("callpath"), server_database_url, env=env) as server:
        yield server.proc, server.url


def _supervisor_calls(text: str) -> float:
    """Messages the supervisor handled that a call could have sent (not views, not admin changes)."""
    kinds = ("LeaseRequest", "ReleaseLease", "RateCheck", "Grow", "WorkerFailed")
    return sum(samples(text, "tensorwasm_supervisor_messages_total", kind=k) for k in kinds)


async def test_warm_calls_never_reach_the_supervisor(node: tuple[Any, str]) -> None:
    proc, base = node
    fronts = await both_fronts(proc, FRONTS)
    async with http(base) as admin:
        _, key = await new_tenant(admin, max_concurrency=2)
        assert (await deploy(admin, key, "echo", wat("echo"))).status_code == 201
        # the first call binds a worker through a lease; every front then knows the tenant's routes
        assert (await admin.post("/v1/functions/echo/invoke", headers=key, content=b"cold")).status_code == 200
        before = _supervisor_calls((await admin.get("/metrics")).text)
        assert before > 0
        for front in fronts:
            async with only(front, fronts), http(base) as client:
                for i in range(10):
                    r = await client.post("/v1/functions/echo/invoke", headers=key, content=f"{front}-{i}".encode())
                    assert r.status_code == 200 and r.text == f"{front}-{i}", r.text
        assert _supervisor_calls((await admin.get("/metrics")).text) == before


async def test_a_tenant_never_runs_more_than_its_concurrency_as_its_guests_count_it(
    node: tuple[Any, str], c_guest: Callable[[str], bytes]
) -> None:
    proc, base = node
    fronts = await both_fronts(proc, FRONTS)
    async with http(base) as admin:
        tid, key = await new_tenant(admin, max_concurrency=2)
        assert (await deploy(admin, key, "span", c_guest("span.c"))).status_code == 201
        assert (await admin.post("/v1/functions/span/invoke", headers=key, content=b"1")).status_code == 200

        async def spare_ready() -> bool:
            return any(w["state"] == "spare" for w in (await admin.get("/v1/admin/workers", headers=ADMIN)).json())

        async def two_workers() -> bool:
            workers = (await admin.get("/v1/admin/workers", headers=ADMIN)).json()
            return sum(w["tenant_id"] == tid for w in workers) >= 2

        # the first call took the spare; its replacement comes ready before the calls below, so the
        # tenant's second worker is a bind, not a start racing them
        await until(spare_ready, "a spare for the tenant's second worker")
        spans: list[tuple[int, int]] = []
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(pinned(base, fronts[i % FRONTS], fronts)) for i in range(12)]

            async def call(client: Any) -> None:
                r = await client.post("/v1/functions/span/invoke", headers=key, content=b"100")
                assert r.status_code == 200, r.text
                start, end = map(int, r.text.split())
                spans.append((start, end))

            # Two calls first: one runs and one queues behind it, which grows the tenant to its
            # second worker. The rest come once it has that worker: calls already queued at a
            # worker stay there, so a burst admitted all at once before the new routes reached
            # the fronts would never run two at a time (on a fast host it failed that way).
            first = [asyncio.create_task(call(c)) for c in clients[:2]]
            await until(two_workers, "the tenant's second worker")
            await asyncio.gather(*first, *(call(c) for c in clients[2:]))
        # the most guests running at one instant, by their own clocks
        events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
        running = peak = 0
        for _, step in events:
            running += step
            peak = max(peak, running)
        assert peak == 2, spans  # never more than its limit, and it grew to it


async def test_the_rate_holds_over_every_front(node: tuple[Any, str]) -> None:
    proc, base = node
    fronts = await both_fronts(proc, FRONTS)
    async with http(base) as admin:
        _, key = await new_tenant(admin, requests_per_second=4, max_concurrency=8)
        assert (await deploy(admin, key, "echo", wat("echo"))).status_code == 201
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(pinned(base, f, fronts)) for f in fronts]
            t0 = time.monotonic()

            async def calls(client: Any) -> list[int]:
                return [(await client.post("/v1/functions/echo/invoke", headers=key, content=b"x")).status_code for _ in range(15)]

            codes = [c for batch in await asyncio.gather(*(calls(c) for c in clients)) for c in batch]
            elapsed = time.monotonic() - t0
    assert set(codes) <= {200, 429}, codes
    # the bucket holds 2 s of the rate (8 calls), and refills at 4 a second
    assert codes.count(200) <= 8 + 4 * elapsed + 1, (codes.count(200), elapsed)
    assert codes.count(429) > 0


async def test_a_tenants_calls_run_in_the_order_they_came_from_every_front(node: tuple[Any, str], c_guest: Callable[[str], bytes]) -> None:
    proc, base = node
    fronts = await both_fronts(proc, FRONTS)
    async with http(base) as admin:
        _, key = await new_tenant(admin, max_concurrency=1)
        assert (await deploy(admin, key, "stamp", c_guest("stamp.c"))).status_code == 201
        assert (await admin.post("/v1/functions/stamp/invoke", headers=key, content=b"1")).status_code == 200  # bound
        started: dict[int, int] = {}
        async with contextlib.AsyncExitStack() as stack:
            # one client per call, each pinned to a front beforehand, the fronts in turn
            clients = [await stack.enter_async_context(pinned(base, fronts[i % FRONTS], fronts)) for i in range(9)]
            for client in clients[:FRONTS]:  # each front knows the key and the function: no lookup delays a call
                assert (await client.post("/v1/functions/stamp/invoke", headers=key, content=b"1")).status_code == 200

            async def call(i: int) -> None:
                r = await clients[i].post("/v1/functions/stamp/invoke", headers=key, content=b"200")
                assert r.status_code == 200, r.text
                started[i] = int(r.text)  # when its guest started, by the guest's own clock

            calls = []
            # one worker, each call 200 ms, one sent every 150 ms: they queue at it, the last for
            # about 0.4 s (the queue wait is 2 s), and the gap is wider than a busy 2-core host's
            # skew between two fronts' work before a call is admitted
            for i in range(9):
                calls.append(asyncio.create_task(call(i)))
                await asyncio.sleep(0.15)
            await asyncio.gather(*calls)
        assert sorted(started, key=started.__getitem__) == list(range(9)), started


async def test_a_worker_killed_with_calls_queued_fails_only_the_one_running(node: tuple[Any, str]) -> None:
    _, base = node
    async with http(base) as client:
        tid, key = await new_tenant(client, max_concurrency=1, timeout_ms=60_000)
        assert (await deploy(client, key, "loop", wat("loop"))).status_code == 201
        assert (await deploy(client, key, "echo", wat("echo"))).status_code == 201
        assert (await client.post("/v1/functions/echo/invoke", headers=key, content=b"warm")).status_code == 200
        running = asyncio.create_task(client.post("/v1/functions/loop/invoke", headers=key))
        busy = await until(lambda: tenant_busy(client, tid), "the call to run")
        queued = [asyncio.create_task(client.post("/v1/functions/echo/invoke", headers=key, content=f"q{i}".encode())) for i in range(3)]
        await asyncio.sleep(0.2)  # sent to the busy worker, queued behind the endless call
        os.kill(busy["pid"], signal.SIGKILL)
        r = await running
        assert r.status_code == 500 and r.json()["error"]["code"] == "worker_crashed", r.text
        # the queued calls had not started: each is sent again, to the worker that replaces it
        answers = [await task for task in queued]
        assert [(q.status_code, q.text) for q in answers] == [(200, f"q{i}") for i in range(3)]


async def test_a_call_queued_at_its_worker_past_the_queue_wait_is_refused_and_the_running_one_ends_at_its_deadline(
    node: tuple[Any, str],
) -> None:
    """Each front gives up a call still queued at the tenant's busy worker at the node's queue
    wait (2 s), with 429 and Retry-After; the call that holds the worker runs on to its own
    deadline (504) and the worker then takes calls again."""
    proc, base = node
    fronts = await both_fronts(proc, FRONTS)
    async with http(base) as admin:
        tid, key = await new_tenant(admin, max_concurrency=1, timeout_ms=6_000)
        assert (await deploy(admin, key, "loop", wat("loop"))).status_code == 201
        assert (await deploy(admin, key, "echo", wat("echo"))).status_code == 201
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(pinned(base, f, fronts)) for f in fronts]
            for client in clients:  # bound, and each front routes the tenant's calls to its worker
                assert (await client.post("/v1/functions/echo/invoke", headers=key, content=b"warm")).status_code == 200
            running = asyncio.create_task(admin.post("/v1/functions/loop/invoke", headers=key))
            await until(lambda: tenant_busy(admin, tid), "the endless call to run")

            async def queued(client: Any) -> tuple[int, str, str | None, float]:
                t0 = time.monotonic()
                r = await client.post("/v1/functions/echo/invoke", headers=key, content=b"late")
                return r.status_code, r.json()["error"]["message"], r.headers.get("retry-after"), time.monotonic() - t0

            answers = await asyncio.gather(*(queued(c) for c in clients))
            assert not running.done()  # refused while the worker was still busy, not when it freed
            for status, message, retry_after, waited in answers:
                assert status == 429 and "queue wait (2000 ms)" in message and retry_after == "1", answers
                assert 1.5 < waited < 5.0, answers
            r = await running
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
        for _ in range(10):  # its worker was replaced: a start that outlasts the queue wait is a 503 to retry
            r = await admin.post("/v1/functions/echo/invoke", headers=key, content=b"after")
            if r.status_code != 503:
                break
            await asyncio.sleep(float(r.headers["retry-after"]))
        assert (r.status_code, r.text) == (200, "after")


async def test_a_killed_front_gives_its_calls_slots_back(node: tuple[Any, str]) -> None:
    proc, base = node
    fronts = await both_fronts(proc, FRONTS)
    doomed = fronts[0]
    async with http(base) as admin:
        tid, key = await new_tenant(admin, max_concurrency=1, timeout_ms=60_000)
        assert (await deploy(admin, key, "loop", wat("loop"))).status_code == 201
        assert (await deploy(admin, key, "echo", wat("echo"))).status_code == 201
        assert (await admin.post("/v1/functions/echo/invoke", headers=key, content=b"warm")).status_code == 200
        async with only(doomed, fronts), http(base) as via:
            lost = asyncio.create_task(via.post("/v1/functions/loop/invoke", headers=key))
            victim = await until(lambda: tenant_busy(admin, tid), "the call to run")
        os.kill(doomed, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await lost

        async def back() -> bool:  # the guest stopped with its caller, the front's counts given back
            usage = (await admin.get("/v1/usage", headers=key)).json()
            return usage["running"] == 0 and usage["queued"] == 0

        await until(back, "the dead front's call to be given back", limit_s=20)
        await both_fronts(proc, FRONTS)  # started again
        r = await admin.post("/v1/functions/echo/invoke", headers=key, content=b"after")
        assert r.status_code == 200 and r.text == "after"
        workers = [w for w in (await admin.get("/v1/admin/workers", headers=ADMIN)).json() if w["tenant_id"] == tid]
        assert [w["id"] for w in workers] == [victim["id"]]  # its guest was stopped, the worker kept


async def test_a_stuck_worker_of_a_silent_front_is_killed_at_the_hard_deadline(node: tuple[Any, str]) -> None:
    proc, base = node
    fronts = await both_fronts(proc, FRONTS)
    a = fronts[0]
    async with http(base) as admin:
        tid, key = await new_tenant(admin, timeout_ms=500)
        assert (await deploy(admin, key, "loop", wat("loop"))).status_code == 201
        assert (await deploy(admin, key, "echo", wat("echo"))).status_code == 201
        assert (await admin.post("/v1/functions/echo/invoke", headers=key, content=b"warm")).status_code == 200
        before = samples((await admin.get("/metrics")).text, "tensorwasm_worker_restarts_total", reason="hard_timeout")
        async with http(base) as via_a:
            async with only(a, fronts):
                call = asyncio.create_task(via_a.post("/v1/functions/loop/invoke", headers=key))
                victim = await until(lambda: tenant_busy(admin, tid), "the call to run")
            # the worker stuck in its call (as in a host call that never returns) and front a
            # silent: neither the guest's own limit nor the front's deadline can end it
            os.kill(victim["pid"], signal.SIGSTOP)
            os.kill(a, signal.SIGSTOP)
            try:
                async with only(fronts[1], fronts):

                    async def killed() -> bool:
                        text = (await admin.get("/metrics")).text
                        return samples(text, "tensorwasm_worker_restarts_total", reason="hard_timeout") > before

                    await until(killed, "the supervisor to kill the overdue worker")
                    assert not process_alive(victim["pid"])
            finally:
                os.kill(a, signal.SIGCONT)
            r = await call
            assert (r.status_code, r.json()["error"]["code"]) in ((504, "timeout"), (500, "worker_crashed")), r.text


async def test_a_call_that_waits_out_the_queue_wait_under_its_limit_is_told_why(server_database_url: str, tmp_path: Path) -> None:
    """On a full node with no spare, a tenant under its `max_concurrency` whose one worker is busy
    does not grow into another tenant's idle worker: its next call waits the queue wait at its
    worker and is refused, and the refusal says that, not that the tenant is at its limit."""
    env = {"TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN, "TENSORWASM_PROCESSES": "2", "TENSORWASM_MAX_WORKERS": "2", "TENSORWASM_WARM_SPARES": "0",
           "TENSORWASM_RESERVED_WORKERS": "0", "TENSORWASM_QUEUE_WAIT_MS": "1000"}
    with server_process(tmp_path, server_database_url, env=env) as server:
        async with http(server.url) as client, http(server.url) as caller:
            _, other = await new_tenant(client)
            assert (await deploy(client, other, "echo", wat("echo"))).status_code == 201
            assert (await client.post("/v1/functions/echo/invoke", headers=other, content=b"x")).status_code == 200
            tid, mine = await new_tenant(client, max_concurrency=2, timeout_ms=30_000)
            for fn in ("loop", "echo"):
                assert (await deploy(client, mine, fn, wat(fn))).status_code == 201
            assert (await client.post("/v1/functions/echo/invoke", headers=mine, content=b"x")).status_code == 200
            running = asyncio.create_task(caller.post("/v1/functions/loop/invoke", headers=mine))
            try:
                await until(lambda: tenant_busy(client, tid), "the endless call to run")
                r = await client.post("/v1/functions/echo/invoke", headers=mine, content=b"late")
                assert r.status_code == 429 and r.headers.get("retry-after") == "1", r.text
                message = r.json()["error"]["message"]
                assert "queue wait (1000 ms)" in message and "1 busy worker" in message and "concurrency limit is 2" in message, message
                assert not running.done()
            finally:
                running.cancel()  # the client goes away: its guest is stopped


async def test_a_tenant_holding_every_worker_gives_one_up_to_a_new_tenant(server_database_url: str, tmp_path: Path) -> None:
    env = {"TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN, "TENSORWASM_PROCESSES": "2", "TENSORWASM_MAX_WORKERS": "2", "TENSORWASM_WARM_SPARES": "1",
           "TENSORWASM_RESERVED_WORKERS": "0", "TENSORWASM_QUEUE_WAIT_MS": "3000"}
    with server_process(tmp_path, server_database_url, env=env) as server:
        async with http(server.url) as client:
            hog_tid, hog = await new_tenant(client, max_concurrency=2, timeout_ms=30_000)
            assert (await deploy(client, hog, "echo", wat("echo"))).status_code == 201
            _, new = await new_tenant(client)
            assert (await deploy(client, new, "echo", wat("echo"))).status_code == 201

            async def hog_workers() -> bool:
                workers = (await client.get("/v1/admin/workers", headers=ADMIN)).json()
                return len([w for w in workers if w["tenant_id"] == hog_tid]) == 2

            stop = asyncio.Event()

            async def keep_busy() -> None:  # short calls, one after another: both its workers busy
                while not stop.is_set():
                    await client.post("/v1/functions/echo/invoke", headers=hog, content=b"x")

            busy = [asyncio.create_task(keep_busy()) for _ in range(4)]
            try:
                await until(hog_workers, "the hog to grow to both workers", limit_s=20)
                r = await client.post("/v1/functions/echo/invoke", headers=new, content=b"mine")
                assert r.status_code == 200 and r.text == "mine", r.text
            finally:
                stop.set()
                await asyncio.gather(*busy)


async def test_a_tenant_whose_calls_queue_takes_turns_beside_another_tenants_call(node: tuple[Any, str]) -> None:
    """A front gives a light tenant's call its steps first (app/node/front_share.py): the flood's
    calls (100 ms each), queued at its one worker, wait for turns only while the other tenant's
    call runs in the same front (or did within the linger), and answer in full either way."""
    proc, base = node
    fronts = await both_fronts(proc, FRONTS)
    sleepy = bytes(wasmtime.wat2wasm((GUESTS / "sleep_echo.wat").read_text().replace("100000000", "3000000000")))  # 3 s
    async with http(base) as admin:
        quiet_id, quiet = await new_tenant(admin, max_concurrency=1)
        _, flood = await new_tenant(admin, max_concurrency=1)
        assert (await deploy(admin, quiet, "sleepy", sleepy)).status_code == 201
        assert (await deploy(admin, flood, "echo", wat("sleep_echo"))).status_code == 201
        for key, name in ((quiet, "sleepy"), (flood, "echo")):  # each bound, its routes on every front
            assert (await admin.post(f"/v1/functions/{name}/invoke", headers=key, content=b"warm")).status_code == 200

        async def turns() -> float:
            return samples((await admin.get("/metrics")).text, "tensorwasm_front_turns_total")

        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(pinned(base, fronts[0], fronts)) for _ in range(7)]

            async def flood_calls() -> None:
                replies = await asyncio.gather(*(
                    c.post("/v1/functions/echo/invoke", headers=flood, content=f"flood-{i}".encode()) for i, c in enumerate(clients[1:])
                ))
                assert [(r.status_code, r.text) for r in replies] == [(200, f"flood-{i}") for i in range(6)]

            await asyncio.sleep(0.2)  # past the linger of the other tenant's warm-up call
            before = await turns()
            await flood_calls()  # queued behind one another, with no light tenant's call in the front
            await asyncio.sleep(1.5)  # every front has published its count
            assert await turns() == before
            slow = asyncio.create_task(clients[0].post("/v1/functions/sleepy/invoke", headers=quiet, content=b"quiet"))
            await until(lambda: tenant_busy(admin, quiet_id), "the other tenant's call to run")
            await flood_calls()
            assert not slow.done()  # all answered while the other call was still in the front
            r = await slow
            assert (r.status_code, r.text) == (200, "quiet")

        async def turns_taken() -> bool:  # each front publishes its count within a second
            return await turns() > before

        await until(turns_taken, "the flood's calls to have waited for turns", limit_s=10)


async def test_a_new_tenants_first_call_to_a_missing_name_is_404_counted_once(node: tuple[Any, str]) -> None:
    """A tenant's first call in a front asks for its lease beside its function's read
    (app/services/invocations.py, `_lease_ahead`): a name that does not exist is still 404, counted
    once against the rate, and the lease asked for it holds no slot. Its bucket holds 2 calls (1 a
    second): counted twice, the next call would be refused."""
    proc, base = node
    fronts = await both_fronts(proc, FRONTS)
    async with http(base) as admin:
        _, key = await new_tenant(admin, requests_per_second=1, max_concurrency=1)
        assert (await deploy(admin, key, "echo", wat("echo"))).status_code == 201
        async with pinned(base, fronts[1], fronts) as client:  # no worker of the tenant anywhere yet
            missing = await client.post("/v1/functions/nope/invoke", headers=key, content=b"x")
            assert missing.status_code == 404, missing.text
            r = await client.post("/v1/functions/echo/invoke", headers=key, content=b"after")
            assert (r.status_code, r.text) == (200, "after")  # its one slot free, one token left
            assert (await client.post("/v1/functions/echo/invoke", headers=key, content=b"x")).status_code == 429

