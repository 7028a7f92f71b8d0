"""Concurrent deploys of one tenant never answer 500: the function count and the names hold
under the tenant's lock in the database (a row lock on PostgreSQL, the write lock taken first on
SQLite), on one front and across fronts (docs/operations.md, "Concurrency of writes")."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import ADMIN, ADMIN_TOKEN, counter_module, deploy, new_tenant, server_process, wat


async def _past_max_functions(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client, max_functions=3)
    noop = wat("noop")
    replies = await asyncio.gather(*(deploy(client, key, f"f{i}", noop) for i in range(20)))
    statuses = Counter(r.status_code for r in replies)
    assert statuses[201] == 3 and statuses[201] + statuses[409] + statuses[429] == 20, statuses
    for r in replies:
        if r.status_code != 201:
            assert r.json()["error"] == {
                "code": "quota_exceeded", "message": "the tenant may deploy at most 3 functions; delete one first",
            }
    listed = (await client.get("/v1/functions", headers=key)).json()
    assert sorted(f["name"] for f in listed) == sorted(r.json()["name"] for r in replies if r.status_code == 201)


async def _one_name(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    modules = [counter_module(tag=f"race-{i}") for i in range(10)]
    replies = await asyncio.gather(*(deploy(client, key, "same", m) for m in modules))
    assert sorted(r.status_code for r in replies) == [200] * 9 + [201], [r.text for r in replies if r.status_code >= 300]
    # each deploy made a version of its own, numbered 1..10 in the order they were written
    versions = {r.json()["version"]: r.json()["sha256"] for r in replies}
    assert sorted(versions) == list(range(1, 11))
    fn = (await client.get("/v1/functions/same", headers=key)).json()
    assert fn["version"] == 10 and fn["sha256"] == versions[10]
    kept = fn["versions"]
    assert kept and kept[-1]["version"] == 10
    assert all(v["sha256"] == versions[v["version"]] for v in kept)
    # the same bytes ten times at once: one function, one version
    replies = await asyncio.gather(*(deploy(client, key, "twice", modules[0]) for _ in range(10)))
    assert sorted(r.status_code for r in replies) == [200] * 9 + [201]
    assert {r.json()["version"] for r in replies} == {1}


async def test_concurrent_deploys_past_max_functions_create_exactly_the_quota(client: httpx.AsyncClient) -> None:
    await _past_max_functions(client)


async def test_concurrent_deploys_of_one_name_make_consistent_versions(client: httpx.AsyncClient) -> None:
    await _one_name(client)


async def test_the_same_races_across_two_fronts_over_tcp(tmp_path: Path, server_database_url: str) -> None:
    """Two front processes of one node: their deploys meet only in the database."""
    env = {"TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN, "TENSORWASM_PROCESSES": "2"}
    with server_process(tmp_path / "node", server_database_url, env=env) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            assert (await client.get("/v1/admin/tenants", headers=ADMIN)).status_code == 200
            await _past_max_functions(client)
            await _one_name(client)


async def test_concurrent_uploads_of_one_kernel_name_never_answer_500(client: httpx.AsyncClient, platform: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    async def checked(*_: Any) -> None:  # the CUDA check needs a GPU; here it only takes time
        await asyncio.sleep(0.05)

    monkeypatch.setattr(platform.compiler, "check_kernel", checked)
    _, key = await new_tenant(client)
    headers = {**key, "Content-Type": "text/plain"}
    replies = await asyncio.gather(*(client.put("/v1/kernels/k", content=f"__global__ void f{i}() {{}}".encode(), headers=headers) for i in range(10)))
    assert sorted(r.status_code for r in replies) == [200] * 9 + [201], [r.text for r in replies if r.status_code >= 300]
