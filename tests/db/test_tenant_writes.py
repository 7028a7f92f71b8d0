"""The repositories' rules for a tenant's writes, on SQLite and PostgreSQL: the tenant lock
serializes writers that check first, stored bytes are counted by length, old versions are pruned
and a module stays referenced while any tenant keeps it, and a claim skips disabled tenants."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.models import Function, FunctionVersion, Invocation
from app.db.repositories.functions import FunctionRepository, referenced_modules
from app.db.repositories.invocations import InvocationRepository
from app.db.repositories.tenants import TenantRepository
from tests.db.helpers import sessionmaker_for, tenant_row


@pytest.fixture
async def sessions(database_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    async with sessionmaker_for(database_url) as sm:
        yield sm


_tenant = tenant_row


async def test_the_tenant_lock_makes_a_second_writer_read_after_the_first(sessions: async_sessionmaker[AsyncSession]) -> None:
    tid = await _tenant(sessions)
    seen: list[int] = []

    async def second() -> None:
        async with sessions() as s:
            assert await TenantRepository(s).lock(tid) is not None
            seen.append(await FunctionRepository(s, tid).count())
            await s.commit()

    async with sessions() as first:
        assert await TenantRepository(first).lock(tid) is not None
        assert await FunctionRepository(first, tid).count() == 0
        waiting = asyncio.create_task(second())
        await asyncio.sleep(0.3)  # room for the second to read, were it not held at its lock
        await FunctionRepository(first, tid).add(Function(name="f", current_version=1, env={}))
        await first.commit()
    await asyncio.wait_for(waiting, 10)
    assert seen == [1]  # it counted the function the first one wrote


async def test_the_lock_reads_the_tenant_as_committed_and_none_once_deleted(sessions: async_sessionmaker[AsyncSession]) -> None:
    tid = await _tenant(sessions, max_stored_bytes=123)
    async with sessions() as s:
        row = await TenantRepository(s).lock(tid)
        assert row is not None and row.max_stored_bytes == 123 and row.disabled is False
        before = row.updated_at
        await s.commit()
    async with sessions() as s:
        row = await TenantRepository(s).get(tid)
        assert row is not None and row.updated_at == before  # the lock changes nothing
        await TenantRepository(s).delete(row)
        await s.commit()
    async with sessions() as s:
        assert await TenantRepository(s).lock(tid) is None


async def test_stored_bytes_and_version_pruning(sessions: async_sessionmaker[AsyncSession]) -> None:
    tid, other = await _tenant(sessions), await _tenant(sessions)
    shared = uuid.uuid4().hex
    now = datetime.now(UTC)
    async with sessions() as s:
        repo = FunctionRepository(s, tid)
        fn = await repo.add(Function(name="f", current_version=4, env={}))
        for v in range(1, 5):
            sha = shared if v == 1 else uuid.uuid4().hex
            await repo.add_version(FunctionVersion(function_id=fn.id, version=v, sha256=sha, size=100 * v, module=b"m" * (100 * v)))
        kept_elsewhere = await FunctionRepository(s, other).add(Function(name="g", current_version=1, env={}))
        await FunctionRepository(s, other).add_version(
            FunctionVersion(function_id=kept_elsewhere.id, version=1, sha256=shared, size=1, module=b"m")
        )
        invocations = InvocationRepository(s, tid)
        # its id kept here: listed by status it could be gone, claimed by a queue runner of another
        # test's app still on this session's loop and database
        queued_id = uuid.uuid4().hex
        for i, (inp, out) in enumerate([(b"i" * 7, None), (None, b"o" * 11), (None, None)]):
            await invocations.add(Invocation(id=queued_id if inp else uuid.uuid4().hex, tenant_id=tid, function="f", mode="async",
                                             status="queued" if inp else "succeeded", created_at=now + timedelta(seconds=i),
                                             input=inp, output_bytes=len(out) if out else None))
        await invocations.add(Invocation(id=uuid.uuid4().hex, tenant_id=tid, function="f", mode="sync",
                                         status="succeeded", created_at=now))
        await s.commit()

        stored = await TenantRepository(s).stored_bytes(tid)
        assert (stored.modules, stored.async_data, stored.total) == (1000, 18, 1018)
        assert (await TenantRepository(s).stored_bytes(tid, except_input_of=queued_id)).async_data == 11

        pruned = await repo.prune_versions(fn, keep=2)
        await s.commit()
        assert len(pruned) == 2 and shared in pruned
        assert [v for v, *_ in await repo.versions(fn)] == [3, 4]
        assert (await TenantRepository(s).stored_bytes(tid)).modules == 700
        # the shared module is still another tenant's version; the other pruned one is no one's
        assert await referenced_modules(s, pruned) == {shared}


async def test_a_claim_skips_disabled_tenants(sessions: async_sessionmaker[AsyncSession]) -> None:
    on, off = await _tenant(sessions), await _tenant(sessions, disabled=True)
    now = datetime(2000, 1, 1, tzinfo=UTC)  # older than any other test's queued work: claimed first
    ids = {}
    async with sessions() as s:  # one transaction: no live node's runner sees these rows first
        for tid in (off, on):
            ids[tid] = uuid.uuid4().hex
            await InvocationRepository(s).add(Invocation(id=ids[tid], tenant_id=tid, function="f", mode="async",
                                                         status="queued", created_at=now))
        lease = datetime.now(UTC) + timedelta(seconds=15)
        claimed = await InvocationRepository(s).claim("test-node", now, lease, 1, [])
        await s.commit()
    assert [inv.id for inv in claimed] == [ids[on]]
    async with sessions() as s:
        assert await InvocationRepository(s, off).cancel_queued_of_tenant(now, "the tenant was disabled") == 1
        await s.commit()
        (row,) = await InvocationRepository(s, off).list(None, 10)
        assert (row.status, row.error, row.input) == ("cancelled", "the tenant was disabled", None)
        for tid in (on, off):  # leave no queued or running work behind for other tests' nodes
            await TenantRepository(s).delete(await TenantRepository(s).get(tid))  # type: ignore[arg-type]
        await s.commit()
