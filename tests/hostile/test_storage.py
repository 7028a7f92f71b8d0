"""A tenant's storage is bounded by its max_stored_bytes quota: stored async outputs, inputs and
kept module versions; old versions are pruned past TENSORWASM_KEPT_VERSIONS, and the compiled
cache follows (docs/operations.md, "Storage quotas")."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import wasmtime

from tests.helpers import ADMIN, counter_module, deploy, new_tenant, submit, wait_status

OUTPUT = 64 * 1024
# writes OUTPUT bytes to stdout once
_WRITER = f"""(module
  (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 2)
  (func (export "_start")
    (i32.store (i32.const 0) (i32.const 1024))
    (i32.store (i32.const 4) (i32.const {OUTPUT}))
    (drop (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))"""


def _module(tag: str, size: int = 0) -> bytes:
    """A distinct module (its own sha256), padded to about `size` bytes by its data segment."""
    return counter_module(tag=tag + "x" * max(0, size - 200))


async def _usage(client: httpx.AsyncClient, key: dict[str, str]) -> dict[str, Any]:
    r = await client.get("/v1/usage", headers=key)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def test_outputs_past_the_quota_are_not_stored_and_later_submits_are_refused(client: httpx.AsyncClient) -> None:
    writer = bytes(wasmtime.wat2wasm(_WRITER))
    quota = len(writer) + OUTPUT * 11 // 2  # room for five and a half outputs
    tid, key = await new_tenant(client, max_stored_bytes=quota, max_concurrency=2, timeout_ms=20_000)
    assert (await deploy(client, key, "writer", writer)).status_code == 201

    replies = await asyncio.gather(*(submit(client, key, "writer") for _ in range(20)))
    assert [r.status_code for r in replies] == [202] * 20  # admitted: nothing stored yet
    records = [await wait_status(client, key, r.json()["id"], "succeeded", "output_limit", "internal_error", timeout_s=120)
               for r in replies]
    stored = [rec for rec in records if rec["status"] == "succeeded"]
    dropped = [rec for rec in records if rec["status"] == "output_limit"]
    # an output is stored while the tenant is under its quota: six of 64 KiB pass 5.5 of them
    assert len(stored) == 6 and len(dropped) == 14, [rec["status"] for rec in records]
    for rec in stored:
        assert len((await client.get(f"/v1/invocations/{rec['id']}/output", headers=key)).content) == OUTPUT
    for rec in dropped:
        assert rec["exit_code"] == 0 and "was not stored" in rec["error"] and "max_stored_bytes" in rec["error"]
        out = await client.get(f"/v1/invocations/{rec['id']}/output", headers=key)
        assert out.status_code == 500 and out.json()["error"]["code"] == "output_limit_exceeded"
        assert (await client.get(f"/v1/invocations/{rec['id']}/output?any=true", headers=key)).content == b""

    usage = await _usage(client, key)
    assert usage["quota"]["max_stored_bytes"] == quota
    assert usage["stored_module_bytes"] == len(writer) and usage["stored_async_bytes"] == 6 * OUTPUT
    assert quota <= usage["stored_bytes"] <= quota + OUTPUT

    # at the quota: refused at the door, saying what to do
    r = await submit(client, key, "writer")
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "storage_quota_exceeded" and "expire" in err["message"] and "delete functions" in err["message"]
    # room again: submits are taken
    r = await client.patch(f"/v1/admin/tenants/{tid}/quota", json={"max_stored_bytes": 2 * quota}, headers=ADMIN)
    assert r.status_code == 200  # both checks read the quota from the database, not a cache
    r = await submit(client, key, "writer")
    assert r.status_code == 202, r.text
    assert (await wait_status(client, key, r.json()["id"], "succeeded", "output_limit"))["status"] == "succeeded"


async def test_an_input_that_would_pass_the_quota_is_refused(client: httpx.AsyncClient) -> None:
    module = _module("inputs")
    _, key = await new_tenant(client, max_stored_bytes=len(module) + 1000)
    assert (await deploy(client, key, "f", module)).status_code == 201
    r = await submit(client, key, "f", b"x" * 1001)
    assert r.status_code == 429 and r.json()["error"]["code"] == "storage_quota_exceeded"
    assert (await _usage(client, key))["stored_async_bytes"] == 0


async def test_a_deploy_past_the_quota_is_refused_after_pruning(app_factory: Callable[..., Any]) -> None:
    size = 2000
    async with app_factory(kept_versions=2, max_workers=1) as (client, _):
        v = [_module(f"prune-{i}", size) for i in range(3)]
        assert all(abs(len(m) - size) < 100 for m in v)
        _, key = await new_tenant(client, max_stored_bytes=len(v[0]) + len(v[1]) + len(v[2]) // 2)
        assert (await deploy(client, key, "f", v[0])).status_code == 201
        assert (await deploy(client, key, "f", v[1])).status_code == 200
        # a third version fits: the first is pruned (two kept)
        assert (await deploy(client, key, "f", v[2])).status_code == 200
        fn = (await client.get("/v1/functions/f", headers=key)).json()
        assert [x["version"] for x in fn["versions"]] == [2, 3]
        # another function's module does not fit beside the two kept
        r = await deploy(client, key, "g", _module("prune-g", size))
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "storage_quota_exceeded"
        assert (await client.get("/v1/functions/g", headers=key)).status_code == 404
        fn = (await client.get("/v1/functions/f", headers=key)).json()
        assert [x["version"] for x in fn["versions"]] == [2, 3]  # the refused deploy pruned nothing
        assert (await _usage(client, key))["stored_module_bytes"] == len(v[1]) + len(v[2])


async def test_thirty_redeploys_keep_the_kept_count_in_the_database_and_the_cache(app_factory: Callable[..., Any]) -> None:
    async with app_factory(max_workers=1) as (client, platform):
        kept = platform.settings.kept_versions
        assert kept == 5
        cache = platform.compiler.cache

        def on_disk() -> set[str]:
            return {p.name.removesuffix(".cwasm") for p in cache.root.glob("*.cwasm")}

        _, key = await new_tenant(client)
        shas = []
        for i in range(30):
            r = await deploy(client, key, "redeployed", _module(f"redeploy-{i}", 4096))
            assert r.status_code in (200, 201), r.text
            shas.append(r.json()["sha256"])
        fn = (await client.get("/v1/functions/redeployed", headers=key)).json()
        assert [x["version"] for x in fn["versions"]] == list(range(31 - kept, 31))
        assert [x["sha256"] for x in fn["versions"]] == shas[-kept:]
        assert on_disk() == set(shas[-kept:])
        # the same module kept by another tenant keeps its artifact when this tenant lets go of it
        _, other = await new_tenant(client)
        assert (await deploy(client, other, "copy", _module("redeploy-29", 4096))).status_code == 201
        assert (await client.delete("/v1/functions/redeployed", headers=key)).status_code == 204
        assert on_disk() == {shas[-1]}
        tid_other = (await client.get("/v1/usage", headers=other)).json()["tenant"]
        tenants = (await client.get("/v1/admin/tenants", headers=ADMIN)).json()
        (other_id,) = [t["id"] for t in tenants if t["name"] == tid_other]
        assert (await client.delete(f"/v1/admin/tenants/{other_id}", headers=ADMIN)).status_code == 204
        assert on_disk() == set()
