"""Compile limits through the API: a compile bomb is refused with 422 naming the limit, the
api process never compiles it, and other tenants keep deploying and calling meanwhile."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import wasmtime
from prometheus_client.parser import text_string_to_metric_families

from app.observability.metrics import COMPILE_KINDS, COMPILE_OUTCOMES
from tests.helpers import compile_bomb, deploy, new_tenant, wat

LOW_MEMORY = 384 * 1024 * 1024  # the bomb below asks for more within a second or two


def compiles(text: str) -> dict[tuple[str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "tensorwasm_compiles_total":
                out[(s.labels["kind"], s.labels["outcome"])] = s.value
    return out


async def echo_works(client: httpx.AsyncClient, key: dict[str, str], name: str) -> None:
    r = await client.post(f"/v1/functions/{name}/invoke", content=b"still here", headers=key)
    assert r.status_code == 200 and r.content == b"still here", r.text


async def test_every_compile_series_exists_from_the_start(client: httpx.AsyncClient) -> None:
    series = compiles((await client.get("/metrics")).text)
    assert set(series) >= {(k, o) for k in COMPILE_KINDS for o in COMPILE_OUTCOMES}
    assert {"wasm", "cuda"} == set(COMPILE_KINDS)
    assert {"ok", "invalid", "memory", "timeout"} <= set(COMPILE_OUTCOMES)


async def test_a_compile_bomb_is_refused_and_other_tenants_are_served(app_factory) -> None:
    async with app_factory(compile_memory_bytes=LOW_MEMORY, compile_timeout_s=120) as (client, platform):
        _, noisy = await new_tenant(client)
        _, quiet = await new_tenant(client)
        assert (await deploy(client, quiet, "echo", wat("echo"))).status_code == 201
        before = compiles((await client.get("/metrics")).text)

        bomb = compile_bomb(5000, 3000)  # 54 KB; cranelift wants > 400 MB for it
        sent = asyncio.create_task(deploy(client, noisy, "bomb", bomb))
        while platform.compiler.sandbox.limiter.running == 0 and not sent.done():
            await asyncio.sleep(0.01)
        # meanwhile (while the bomb compiles, if it still does): another tenant deploys and calls
        assert (await deploy(client, quiet, "echo2", wat("echo"))).status_code == 201
        await echo_works(client, quiet, "echo2")

        r = await sent
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "module_too_complex"
        assert f"more than {LOW_MEMORY} bytes of memory (TENSORWASM_COMPILE_MEMORY_BYTES)" in err["message"]
        assert (await client.get("/v1/functions/bomb", headers=noisy)).status_code == 404  # nothing stored

        # afterwards: the node is whole, for the noisy tenant too
        assert (await deploy(client, quiet, "echo3", wat("echo"))).status_code == 201
        await echo_works(client, quiet, "echo3")
        await echo_works(client, quiet, "echo")
        assert (await deploy(client, noisy, "fine", wat("echo"))).status_code == 201
        await echo_works(client, noisy, "fine")

        after = compiles((await client.get("/metrics")).text)
        assert after[("wasm", "memory")] - before[("wasm", "memory")] == 1
        assert after[("wasm", "ok")] - before[("wasm", "ok")] == 3


async def test_the_time_limit_refuses_with_its_own_message(app_factory) -> None:
    async with app_factory(compile_timeout_s=1) as (client, platform):
        _, key = await new_tenant(client)
        r = await deploy(client, key, "slow", compile_bomb(1500, 8000))  # tens of seconds to compile
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "module_too_complex"
        assert "took longer than 1 s (TENSORWASM_COMPILE_TIMEOUT_S)" in err["message"]
        assert compiles((await client.get("/metrics")).text)[("wasm", "timeout")] == 1
        assert (await deploy(client, key, "echo", wat("echo"))).status_code == 201


async def test_invalid_modules_keep_their_codes(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    r = await deploy(client, key, "junk", b"\0asm\x01\0\0\0\xff")
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_module"
    assert "not a valid WebAssembly module" in r.json()["error"]["message"]
    r = await deploy(client, key, "imp", wat("forbidden_import"))
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_module"
    assert "is not allowed" in r.json()["error"]["message"]


async def test_a_recompile_after_a_cache_loss_runs_in_the_sandbox(client: httpx.AsyncClient, platform) -> None:
    _, key = await new_tenant(client)
    tag = uuid.uuid4().hex  # bytes no other test deploys
    module = bytes(wasmtime.wat2wasm(f'(module (memory (export "memory") 1) (data (i32.const 0) "{tag}") (func (export "_start")))'))
    r = await deploy(client, key, "lost", module)
    assert r.status_code == 201
    tenant_id = next(t for t, n in platform.function_cache._fns if n == "lost")
    artifact = platform.compiler.cache.path_for(r.json()["sha256"])
    jobs: list[tuple[str, str]] = []
    sandbox = platform.compiler.sandbox
    real_run = sandbox.run

    async def spy(tenant: str, kind, payload: bytes, **params):
        jobs.append((tenant, kind.value))
        return await real_run(tenant, kind, payload, **params)

    artifact.unlink()  # the node lost its compiled copy (a new node, a wiped cache)
    platform.function_cache.drop(tenant_id, "lost")
    sandbox.run = spy
    try:
        r = await client.post("/v1/functions/lost/invoke", headers=key)
    finally:
        del sandbox.run
    assert r.status_code == 200, r.text
    assert jobs == [(tenant_id, "wasm")] and artifact.exists()
