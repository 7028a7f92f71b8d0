"""Calls to functions that do not exist: they count against the tenant's rate, are remembered as
missing for one TTL (bounded), are never kept fresh in the background, and a deploy on this node
makes the name callable at once."""

from __future__ import annotations

import uuid
from contextlib import asynccontextmanager
from typing import Any

import pytest

from app.errors import NotFound
from app.services.function_cache import FunctionCache
from tests.helpers import deploy, new_tenant, wat


def _random_name() -> str:
    return f"nope-{uuid.uuid4().hex[:12]}"


class _CountingSessions:
    """A sessionmaker that counts the sessions opened (each is a database round)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.opened = 0

    @asynccontextmanager
    async def __call__(self):  # type: ignore[no-untyped-def]
        self.opened += 1
        async with self.inner() as session:
            yield session


async def test_unknown_names_count_against_the_rate(client) -> None:
    _, key = await new_tenant(client, requests_per_second=1)  # burst of 2
    codes = []
    for _ in range(6):
        r = await client.post(f"/v1/functions/{_random_name()}/invoke", headers=key)
        codes.append(r.status_code)
    assert codes[:2] == [404, 404] and codes[2:] == [429] * 4, codes
    assert r.json()["error"]["code"] == "rate_limited" and int(r.headers["retry-after"]) >= 1


async def test_random_names_cost_bounded_memory_and_no_background_reads(client, platform) -> None:
    tid, key = await new_tenant(client)
    for name in ("f1", "f2", "f3"):
        assert (await deploy(client, key, name, wat("echo"))).status_code == 201
    sessions = _CountingSessions(platform.sessionmaker)
    cache = FunctionCache(sessions, platform.compiler, ttl_s=60, max_entries=2)  # type: ignore[arg-type]

    names = [_random_name() for _ in range(50)]
    for name in names:
        with pytest.raises(NotFound):
            await cache.lookup(tid, name)
    assert len(cache._missing) == 2 and not cache._used and not cache._fns
    assert set(cache._missing) == {(tid, n) for n in names[-2:]}  # the most recent ones

    opened = sessions.opened
    with pytest.raises(NotFound):
        await cache.lookup(tid, names[-1])  # remembered as missing: no database round
    assert sessions.opened == opened
    await cache.refresh(keep_s=300)  # nothing found, nothing to keep fresh: no database round
    assert sessions.opened == opened

    for name in ("f1", "f2", "f3"):  # found functions are kept fresh, the least recent dropped
        assert (await cache.lookup(tid, name))[0].name == name
    assert list(cache._used) == [(tid, "f2"), (tid, "f3")]
    await cache.refresh(keep_s=300)
    assert set(cache._fns) == {(tid, "f2"), (tid, "f3")}


async def test_a_deploy_after_a_404_is_callable_at_once(client, platform) -> None:
    tid, key = await new_tenant(client)
    r = await client.post("/v1/functions/late/invoke", content=b"x", headers=key)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert (tid, "late") in platform.function_cache._missing  # the app's cache remembers the miss
    assert (await deploy(client, key, "late", wat("echo"))).status_code == 201
    r = await client.post("/v1/functions/late/invoke", content=b"x", headers=key)
    assert r.status_code == 200 and r.content == b"x"
    assert (tid, "late") not in platform.function_cache._missing
    # and a delete makes it missing again for this node, at once
    assert (await client.delete("/v1/functions/late", headers=key)).status_code == 204
    assert (await client.post("/v1/functions/late/invoke", content=b"x", headers=key)).status_code == 404
    assert (tid, "late") not in platform.function_cache._used
