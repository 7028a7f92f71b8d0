"""Refresh-ahead of the per-node caches: fresh for active callers, changes from elsewhere seen,
local changes never overwritten by an older read. Each test builds its own cache, which plays
another node's: the API's changes do not reach it except through the database."""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import event

from app.db.session import create_engine_for, create_sessionmaker
from app.errors import DomainError, NotFound
from app.services.api_keys import ApiKeyService, AuthCache, hash_key
from app.services.cache_refresh import CacheRefresher
from app.services.function_cache import FunctionCache
from tests.helpers import ADMIN, deploy, new_tenant, until, wat


async def _key_entry(platform, headers: dict[str, str], cache: AuthCache) -> str:
    token = headers["Authorization"].split()[1]
    async with platform.sessionmaker() as s:
        found = await ApiKeyService(s).authenticate(token)
    assert found is not None
    cache.put(hash_key(token), *found)
    return hash_key(token)


async def test_auth_refresh_extends_active_keys_and_drops_revoked_and_idle_ones(client, platform) -> None:
    tid, headers = await new_tenant(client)
    cache = AuthCache(ttl_s=0.2)
    active = await _key_entry(platform, headers, cache)
    time.sleep(0.25)
    assert cache.get(active) is None  # expired: a call now would read the database
    async with platform.sessionmaker() as s:
        await cache.refresh(s, keep_s=60)
    assert cache.get(active) is not None  # used within keep_s: re-read and valid again

    # what follows is about the refresh, not expiry: entries it makes from here on outlive a busy
    # host's revocation call
    cache.ttl_s = 60
    async with platform.sessionmaker() as s:
        await cache.refresh(s, keep_s=60)
    key_id = cache._entries[active].key_id
    assert (await client.delete(f"/v1/admin/tenants/{tid}/api-keys/{key_id}", headers=ADMIN)).status_code == 204
    assert cache.get(active) is not None  # this cache has not heard of it yet
    async with platform.sessionmaker() as s:
        await cache.refresh(s, keep_s=60)
    assert cache.get(active) is None

    _, other = await new_tenant(client)
    cache2 = AuthCache(ttl_s=60)
    idle = await _key_entry(platform, other, cache2)
    cache2._entries[idle].last_used -= 120
    async with platform.sessionmaker() as s:
        await cache2.refresh(s, keep_s=60)
    assert idle not in cache2._entries


async def test_function_refresh_sees_redeploys_deletes_and_kernels_from_elsewhere(client, platform) -> None:
    tid, headers = await new_tenant(client)
    assert (await deploy(client, headers, "f", wat("echo"))).status_code == 201
    cache = FunctionCache(platform.sessionmaker, platform.compiler, ttl_s=60)
    meta, kernels = await cache.lookup(tid, "f")
    assert meta.version == 1 and kernels.sources == {}
    empty_version = kernels.version
    first_sha = meta.sha256

    assert (await deploy(client, headers, "f", wat("exit3"))).status_code == 200
    source = b'extern "C" __global__ void k1(float* x) { x[0] = 1.0f; }'
    r = await client.put("/v1/kernels/k1", content=source, headers={**headers, "Content-Type": "text/plain"})
    assert r.status_code in (200, 201), r.text
    assert (await cache.lookup(tid, "f"))[0].version == 1  # stale until refreshed
    await cache.refresh(keep_s=60)
    meta, kernels = await cache.lookup(tid, "f")
    assert meta.version == 2 and meta.sha256 != first_sha
    assert set(kernels.sources) == {"k1"} and kernels.version != empty_version  # the sources' hash

    assert (await client.delete("/v1/functions/f", headers=headers)).status_code == 204
    await cache.refresh(keep_s=60)
    with pytest.raises(NotFound) as err:
        await cache.function(tid, "f")
    assert err.value.message == "function 'f' not found"


async def test_a_local_change_during_a_refresh_is_not_overwritten(client, platform, monkeypatch) -> None:
    tid, headers = await new_tenant(client)
    assert (await deploy(client, headers, "f", wat("echo"))).status_code == 201
    cache = FunctionCache(platform.sessionmaker, platform.compiler, ttl_s=60)
    old, _ = await cache.lookup(tid, "f")
    newer = type(old)(**{**old.__dict__, "version": 99})
    load = FunctionCache._meta_of

    async def racing_load(self, session, tenant_id, fn, ver):  # type: ignore[no-untyped-def]
        read = await load(self, session, tenant_id, fn, ver)  # the database's (older) view
        self.remember(tenant_id, newer)  # a deploy on this node lands meanwhile
        return read

    monkeypatch.setattr(FunctionCache, "_meta_of", racing_load)
    await cache.refresh(keep_s=60)
    assert (await cache.function(tid, "f")).version == 99


async def test_an_idle_function_is_forgotten_and_the_refresher_loop_runs(client, platform) -> None:
    tid, headers = await new_tenant(client)
    assert (await deploy(client, headers, "f", wat("echo"))).status_code == 201
    cache = FunctionCache(platform.sessionmaker, platform.compiler, ttl_s=0.2)
    await cache.lookup(tid, "f")
    refresher = CacheRefresher(platform.sessionmaker, AuthCache(0.2), cache, ttl_s=0.2, keep_s=60)
    refresher.start()
    try:
        time.sleep(0.25)  # expired now; the loop (every 0.1 s) brings it back without a call
        deadline = time.monotonic() + 5
        while (tid, "f") not in cache._fns or cache._fns[(tid, "f")].expires < time.monotonic():
            assert time.monotonic() < deadline, "the refresher never refreshed the entry"
            await asyncio.sleep(0.05)
    finally:
        await refresher.stop()
    cache._used[(tid, "f")] -= 120
    await cache.refresh(keep_s=60)
    assert (tid, "f") not in cache._fns


async def test_stopping_lets_a_refresh_under_way_finish(client, platform, monkeypatch) -> None:
    """Cancelled inside its session, a refresh's connection reset is cancelled too (logged as an
    error at every node shutdown that lands in one); stop waits for it instead."""
    refresher = CacheRefresher(platform.sessionmaker, AuthCache(60), FunctionCache(platform.sessionmaker, platform.compiler, ttl_s=60), ttl_s=0.1, keep_s=60)
    inside, finished = asyncio.Event(), []

    async def slow_refresh() -> None:
        async with platform.sessionmaker() as s:
            inside.set()
            await asyncio.sleep(0.2)  # mid-refresh when stop comes
            await s.commit()
        finished.append(True)

    monkeypatch.setattr(refresher, "refresh", slow_refresh)
    refresher.start()
    await asyncio.wait_for(inside.wait(), 5)
    await refresher.stop()
    assert finished == [True]
    assert refresher._task is not None and refresher._task.done() and not refresher._task.cancelled()


async def test_a_refresh_reads_every_function_and_kernel_set_in_the_same_few_queries(client, platform, database_url) -> None:
    """A loaded front keeps dozens of functions fresh: one query each had outlasted the entries."""
    statements: list[str] = []

    def count(conn, cursor, statement, *_: object) -> None:  # type: ignore[no-untyped-def]
        statements.append(statement)

    engine = create_engine_for(database_url)  # the cache's own: no other task's statements
    cache = FunctionCache(create_sessionmaker(engine), platform.compiler, ttl_s=60)
    try:
        tid, headers = await new_tenant(client)
        assert (await deploy(client, headers, "f", wat("echo"))).status_code == 201
        await cache.lookup(tid, "f")
        await cache.refresh(keep_s=60)  # a connection's first use may set it up
        event.listen(engine.sync_engine, "before_cursor_execute", count)
        await cache.refresh(keep_s=60)
        one = len(statements)
        assert one == 2, statements  # the functions, the kernels
        source = b'extern "C" __global__ void k1(float* x) { x[0] = 1.0f; }'
        for _ in range(3):
            t, h = await new_tenant(client)
            for name in ("f", "g"):
                assert (await deploy(client, h, name, wat("echo"))).status_code == 201
                await cache.lookup(t, name)
            r = await client.put("/v1/kernels/k1", content=source, headers={**h, "Content-Type": "text/plain"})
            assert r.status_code == 201, r.text
        statements.clear()
        await cache.refresh(keep_s=60)
        assert len(statements) == one, statements
    finally:
        await engine.dispose()
    assert len(cache._fns) == 7
    assert all(set(ks.sources) == {"k1"} for t, (_, ks) in cache._kernels.items() if t != tid)


async def test_calls_that_miss_together_share_one_read(client, platform, monkeypatch) -> None:
    tid, headers = await new_tenant(client)
    assert (await deploy(client, headers, "f", wat("echo"))).status_code == 201
    cache = FunctionCache(platform.sessionmaker, platform.compiler, ttl_s=60)
    reads, go = [], asyncio.Event()
    load = cache._load_function

    async def slow_load(session, tenant_id, name, number=None):  # type: ignore[no-untyped-def]
        reads.append(name)
        await go.wait()
        return await load(session, tenant_id, name, number)

    monkeypatch.setattr(cache, "_load_function", slow_load)  # this cache's alone, not the node's own
    calls = [asyncio.create_task(cache.lookup(tid, "f")) for _ in range(20)]
    await until(lambda: reads == ["f"], "the first read")
    calls[0].cancel()  # a caller gone: the read goes on for the others
    go.set()
    got = await asyncio.gather(*calls[1:])
    assert reads == ["f"] and calls[0].cancelled()
    assert {m.sha256 for m, _ in got} == {got[0][0].sha256} and got[0][0].version == 1

    # a change here while a read is under way: a call after it reads again, not what began before
    go.clear()
    cache.drop(tid, "f")
    first = asyncio.create_task(cache.lookup(tid, "f"))
    await until(lambda: len(reads) == 2, "the second read")
    assert (await deploy(client, headers, "f", wat("exit3"))).status_code == 200  # version 2 in the database
    cache.drop(tid, "f")  # what that deploy does to the cache of the front that served it
    second = asyncio.create_task(cache.lookup(tid, "f"))
    await until(lambda: len(reads) == 3, "the third read")
    go.set()
    assert (await second)[0].version == 2
    await first  # began before: either version is right for it
    assert not cache._reads

    # a miss that fails fails every caller that shared it, and the next call reads again
    cache.drop(tid, "f")
    assert (await client.delete("/v1/functions/f", headers=headers)).status_code == 204
    missing = await asyncio.gather(*(cache.lookup(tid, "f") for _ in range(5)), return_exceptions=True)
    assert all(isinstance(e, NotFound) for e in missing) and len(reads) == 4 and not cache._reads


async def test_a_function_that_cannot_be_compiled_here_is_dropped_not_called_missing(client, platform, monkeypatch) -> None:
    """Its calls then read it and get the compile error, not a 404; the refresh stops compiling it."""
    tid, headers = await new_tenant(client)
    assert (await deploy(client, headers, "f", wat("echo"))).status_code == 201
    cache = FunctionCache(platform.sessionmaker, platform.compiler, ttl_s=60)
    await cache.lookup(tid, "f")

    async def cannot(*_: object) -> None:
        raise DomainError("the module cannot be compiled here")

    monkeypatch.setattr(cache, "_meta_of", cannot)
    await cache.refresh(keep_s=60)
    assert (tid, "f") not in cache._fns and (tid, "f") not in cache._used
    assert not cache.known_missing(tid, "f")
    with pytest.raises(DomainError, match="cannot be compiled"):
        await cache.lookup(tid, "f")
