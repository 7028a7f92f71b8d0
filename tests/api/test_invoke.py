"""Invoke through the HTTP API, on real worker processes (CPU backend)."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import httpx
import wasmtime

from tests.helpers import ADMIN, counter_module, deploy, new_tenant, wat


async def invoke(client: httpx.AsyncClient, key: dict, name: str, body: bytes = b"", headers: dict | None = None, **kw) -> httpx.Response:
    return await client.post(f"/v1/functions/{name}/invoke", content=body, headers={**key, **(headers or {})}, **kw)


async def test_echo_one_mib_byte_exact(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "echo", wat("echo"))
    body = os.urandom(1 << 20)
    r = await invoke(client, key, "echo", body)
    assert r.status_code == 200
    assert r.content == body
    assert len(r.headers["x-invocation-id"]) == 32


async def test_content_type_of_response(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "echo", wat("echo"), content_type="text/plain; charset=utf-8")
    r = await invoke(client, key, "echo", b"hi")
    assert r.headers["content-type"] == "text/plain; charset=utf-8" and r.text == "hi"


async def test_exit_code_and_stderr(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "exit3", wat("exit3"))
    r = await invoke(client, key, "exit3")
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "guest_error" and err["exit_code"] == 3 and "3" in err["message"]
    assert "something went wrong" in err["stderr_tail"]
    rec = (await client.get(f"/v1/invocations/{r.headers['x-invocation-id']}", headers=key)).json()
    assert rec["status"] == "guest_error" and rec["exit_code"] == 3
    assert rec["stderr_tail"] == "something went wrong\n"


async def test_trap_is_guest_error(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "trap", wat("trap"))
    r = await invoke(client, key, "trap")
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "guest_error" and "unreachable" in err["message"]


async def test_endless_loop_is_504_then_next_call_fine(client: httpx.AsyncClient, platform) -> None:
    _, key = await new_tenant(client, timeout_ms=500)
    await deploy(client, key, "loop", wat("loop"))
    await deploy(client, key, "echo", wat("echo"))
    killed = platform.scheduler.restarts["hard_timeout"]
    r = await invoke(client, key, "loop")
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    # stopped inside the worker at the tenant's deadline (epoch interruption), not by the
    # supervisor's hard deadline: the worker was not killed for it
    assert "500 ms" in r.json()["error"]["message"]
    assert platform.scheduler.restarts["hard_timeout"] == killed
    r = await invoke(client, key, "echo", b"still alive")
    assert r.status_code == 200 and r.content == b"still alive"


async def test_memory_grow_past_quota_is_refused(client: httpx.AsyncClient) -> None:
    _, small = await new_tenant(client, wasm_memory_bytes=16 * 1024 * 1024)
    _, big = await new_tenant(client, wasm_memory_bytes=256 * 1024 * 1024)
    for key in (small, big):
        await deploy(client, key, "grow", wat("grow"))
    assert (await invoke(client, small, "grow")).content == b"refused"
    assert (await invoke(client, big, "grow")).content == b"grew"


def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def test_stdout_flood_stops_at_the_cap(app_factory) -> None:
    async with app_factory(stdout_limit_bytes=4 * 1024 * 1024) as (client, platform):
        _, key = await new_tenant(client, timeout_ms=20_000)
        await deploy(client, key, "flood", wat("flood"))
        assert (await invoke(client, key, "flood")).status_code == 500  # binds a worker
        worker = next(w for w in platform.scheduler.workers if w.tenant_id)
        worker_before, before = _rss_kib(worker.pid), _rss_kib(os.getpid())
        r = await invoke(client, key, "flood")
        assert r.status_code == 500 and r.json()["error"]["code"] == "output_limit_exceeded"
        # the worker's own footprint (a CUDA context's host memory too) is not the flood's
        assert _rss_kib(worker.pid) - worker_before < 32 * 1024, "the worker buffered the flood"
        assert _rss_kib(os.getpid()) - before < 32 * 1024, "the api process buffered the flood"


async def test_env_argv_and_query(client: httpx.AsyncClient, c_guest) -> None:
    tid, key = await new_tenant(client)
    tenant = (await client.get(f"/v1/admin/tenants/{tid}", headers=ADMIN)).json()["name"]
    await deploy(client, key, "hello", c_guest("hello.c"), env=["GREETING=hi there"], cgi="true")
    r = await invoke(client, key, "hello", b"payload", params={"a": "1", "b": "x y"}, headers={"Content-Type": "text/x-test"})
    assert r.status_code == 200, r.text
    lines = dict(line.split("=", 1) for line in r.text.strip().splitlines())
    assert lines["argv0"] == "hello"
    assert lines["TW_FUNCTION"] == "hello"
    assert lines["TW_INVOCATION_ID"] == r.headers["x-invocation-id"]
    assert lines["TW_TENANT"] == tenant
    assert lines["QUERY_STRING"] == "a=1&b=x+y"
    assert lines["CONTENT_TYPE"] == "text/x-test"
    assert lines["GREETING"] == "hi there"
    assert lines["body"] == "payload"
    r = await invoke(client, key, "hello", b"fail")
    assert r.status_code == 500 and r.json()["error"]["exit_code"] == 7


async def test_concurrency_limit_429_with_retry_after(app_factory, c_guest) -> None:
    # a queue wait shorter than the calls, whatever the backend (the CUDA tests' default is 30 s)
    async with app_factory(queue_wait_ms=300) as (client, _):
        _, key = await new_tenant(client, max_concurrency=1)
        await deploy(client, key, "spin", c_guest("spin.c"))
        assert (await invoke(client, key, "spin", b"1")).status_code == 200  # bind first
        results = await asyncio.gather(*[invoke(client, key, "spin", b"1500") for _ in range(3)])
    codes = sorted(r.status_code for r in results)
    assert codes[0] == 200 and 429 in codes, codes
    limited = next(r for r in results if r.status_code == 429)
    assert int(limited.headers["retry-after"]) >= 1
    assert limited.json()["error"]["code"] == "rate_limited"


async def test_queued_call_runs_when_a_slot_frees(app_factory, c_guest) -> None:
    # a queue wait far past the first call's 100 ms: on a busy host its spin and release take longer
    async with app_factory(queue_wait_ms=5000) as (client, _):
        _, key = await new_tenant(client, max_concurrency=1)
        await deploy(client, key, "spin", c_guest("spin.c"))
        assert (await invoke(client, key, "spin", b"1")).status_code == 200
        a, b = await asyncio.gather(invoke(client, key, "spin", b"100"), invoke(client, key, "spin", b"10"))
        assert a.status_code == b.status_code == 200  # the second waited in the queue


async def test_rate_limit_token_bucket(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client, requests_per_second=2)  # burst of 4
    await deploy(client, key, "noop", wat("noop"))
    codes = [(await invoke(client, key, "noop")).status_code for _ in range(6)]
    assert codes[:4] == [200] * 4 and codes[-1] == 429
    r = await invoke(client, key, "noop")
    assert r.headers["retry-after"] == "1"


async def test_sigkill_mid_call_fails_only_that_call(client: httpx.AsyncClient, platform, c_guest) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "spin", c_guest("spin.c"))
    assert (await invoke(client, key, "spin", b"1")).status_code == 200
    call = asyncio.create_task(invoke(client, key, "spin", b"3000"))
    for _ in range(100):
        busy = [w for w in platform.scheduler.workers if w.state == "busy"]
        if busy:
            break
        await asyncio.sleep(0.02)
    os.kill(busy[0].pid, signal.SIGKILL)
    r = await call
    assert r.status_code == 500 and r.json()["error"]["code"] == "worker_crashed"
    assert platform.scheduler.restarts["crashed"] >= 1
    r = await invoke(client, key, "spin", b"1")
    assert r.status_code == 200 and r.content == b"done"


async def test_eviction_when_more_tenants_than_workers(app_factory) -> None:
    async with app_factory(max_workers=2, warm_spares=1) as (client, platform):
        tenants = [await new_tenant(client) for _ in range(3)]
        for _, key in tenants:
            await deploy(client, key, "echo", wat("echo"))
        for round_ in range(2):
            for i, (_, key) in enumerate(tenants):
                r = await invoke(client, key, "echo", f"{round_}-{i}".encode())
                assert r.status_code == 200 and r.content == f"{round_}-{i}".encode()
        assert platform.scheduler.restarts["evicted"] >= 1
        assert len([w for w in platform.scheduler.workers if w.state != "dead"]) <= 2
        # no worker ever served two tenants
        bound = [w for w in platform.scheduler.workers if w.tenant_id]
        assert len({w.id for w in bound}) == len(bound)


async def test_invocation_records_are_private(client: httpx.AsyncClient) -> None:
    _, a = await new_tenant(client)
    _, b = await new_tenant(client)
    await deploy(client, a, "echo", wat("echo"))
    await deploy(client, a, "noop", wat("noop"))
    r = await invoke(client, a, "echo", b"x")
    inv = r.headers["x-invocation-id"]
    await invoke(client, a, "noop")
    got = (await client.get(f"/v1/invocations/{inv}", headers=a)).json()
    assert got["status"] == "succeeded" and got["function"] == "echo" and got["version"] == 1 and got["exit_code"] == 0
    assert (await client.get(f"/v1/invocations/{inv}", headers=b)).status_code == 404
    assert (await client.get("/v1/invocations", headers=b)).json()["items"] == []
    only_echo = (await client.get("/v1/invocations", params={"function": "echo"}, headers=a)).json()["items"]
    assert [i["id"] for i in only_echo] == [inv]
    assert len((await client.get("/v1/invocations", headers=a)).json()["items"]) == 2


async def test_usage_reports_quota_and_counts(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client, max_functions=9)
    await deploy(client, key, "echo", wat("echo"))
    await invoke(client, key, "echo", b"x")
    u = (await client.get("/v1/usage", headers=key)).json()
    assert u["quota"]["max_functions"] == 9 and u["functions"] == 1 and u["workers"] == 1
    assert u["running"] == 0 and u["gpu_bytes_in_use"] == 0


async def test_invoke_unknown_function_is_404(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    r = await invoke(client, key, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


async def test_redeploy_is_picked_up_by_the_next_call(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "f", wat("echo"))
    assert (await invoke(client, key, "f", b"abc")).content == b"abc"
    await deploy(client, key, "f", wat("noop"))
    r = await invoke(client, key, "f", b"abc")
    assert r.status_code == 200 and r.content == b""


async def test_every_call_runs_on_a_fresh_instance_with_or_without_a_start_function(client, platform) -> None:
    """The worker builds the next call's instance ahead only for a module without a start
    function (the compile records which); either way each call sees its data segments as set."""
    _, key = await new_tenant(client)
    unique = uuid.uuid4().hex  # modules no other test shares
    for name, start, out in (("plain", False, b"1"), ("started", True, b"2")):
        r = await deploy(client, key, name, counter_module(start_function=start, tag=unique))
        assert r.status_code == 201, r.text
        assert platform.compiler.cache.has_no_start_function(r.json()["sha256"]) is not start
        for _ in range(4):
            r = await invoke(client, key, name)
            assert r.status_code == 200 and r.content == out, r.text


async def test_an_unreadable_compiled_artifact_fails_one_call_and_is_rebuilt(client, platform) -> None:
    _, key = await new_tenant(client)
    unique = uuid.uuid4().hex  # a module no other test shares, so no worker holds it already
    module = wasmtime.wat2wasm(f'(module (memory (export "memory") 1) (data (i32.const 0) "{unique}") (func (export "_start")))')
    r = await deploy(client, key, "fragile", bytes(module))
    assert r.status_code == 201
    artifact = platform.compiler.cache.path_for(r.json()["sha256"])
    artifact.write_bytes(b"not a compiled module")
    r = await invoke(client, key, "fragile")
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "internal" and "compiled code could not be loaded" in err["message"] and "retry" in err["message"]
    assert not artifact.exists()  # discarded
    r = await invoke(client, key, "fragile")  # recompiled from the stored module, same worker
    assert r.status_code == 200, r.text
    assert artifact.exists()
