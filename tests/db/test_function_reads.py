"""A function's active version read in one query (`FunctionRepository.active`), and many of them
at once (`active_functions`, with `kernel_sources`, a front's cache refresh), on SQLite and
PostgreSQL: the version the function points at (not the newest after a rollback), its settings
without its module bytes, and nothing of another tenant's."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.exc import InvalidRequestError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.models import Function, FunctionVersion, Kernel
from app.db.repositories.functions import FunctionRepository, active_functions
from app.db.repositories.kernels import KernelRepository, kernel_sources
from tests.db.helpers import sessionmaker_for, tenant_row


@pytest.fixture
async def sessions(database_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    async with sessionmaker_for(database_url) as sm:
        yield sm


async def _function(sm: async_sessionmaker[AsyncSession], tid: str, name: str, versions: int, current: int) -> None:
    async with sm() as s:
        repo = FunctionRepository(s, tid)
        fn = await repo.add(Function(name=name, current_version=current, env={}))
        for n in range(1, versions + 1):
            await repo.add_version(
                FunctionVersion(function_id=fn.id, version=n, sha256=f"{n:064x}", size=3, module=b"\0asm" + bytes([n]), timeout_ms=100 * n)
            )
        await s.commit()


async def test_active_reads_the_version_the_function_points_at(sessions: async_sessionmaker[AsyncSession]) -> None:
    tid = await tenant_row(sessions)
    await _function(sessions, tid, "f", versions=3, current=2)  # rolled back from 3 to 2
    async with sessions() as s:
        found = await FunctionRepository(s, tid).active("f")
        assert found is not None
        fn, ver = found
        assert (fn.name, ver.version, ver.sha256, ver.timeout_ms) == ("f", 2, f"{2:064x}", 200)
        assert ver.function_id == fn.id
        with pytest.raises(InvalidRequestError):  # the module's bytes are not read with it
            _ = ver.module


async def test_active_finds_nothing_missing_or_of_another_tenant(sessions: async_sessionmaker[AsyncSession]) -> None:
    owner, other = await tenant_row(sessions), await tenant_row(sessions)
    await _function(sessions, owner, "f", versions=1, current=1)
    await _function(sessions, owner, "dangling", versions=1, current=5)  # points at no kept version
    async with sessions() as s:
        assert await FunctionRepository(s, other).active("f") is None
        assert await FunctionRepository(s, owner).active("g") is None
        assert await FunctionRepository(s, owner).active("dangling") is None
        assert await FunctionRepository(s, owner).active("f") is not None


async def test_active_functions_reads_each_key_of_its_own_tenant_in_chunks(sessions: async_sessionmaker[AsyncSession]) -> None:
    a, b = await tenant_row(sessions), await tenant_row(sessions)
    await _function(sessions, a, "f", versions=3, current=2)
    await _function(sessions, a, "g", versions=1, current=1)
    await _function(sessions, b, "f", versions=2, current=1)
    await _function(sessions, b, "dangling", versions=1, current=4)
    keys = [(a, "f"), (a, "g"), (b, "f"), (b, "g"), (a, "missing"), (b, "dangling")]
    async with sessions() as s:
        found = await active_functions(s, keys, chunk=2)  # three queries
        single = {k: await FunctionRepository(s, k[0]).active(k[1]) for k in keys}
    assert set(found) == {(a, "f"), (a, "g"), (b, "f")}  # (b, "g") is a's name only; none of the rest exists
    for key, (fn, ver) in found.items():
        one = single[key]
        assert one is not None
        assert (fn.tenant_id, fn.name, fn.id, ver.version, ver.sha256) == (*key, one[0].id, one[1].version, one[1].sha256)
    assert found[(a, "f")][1].version == 2 and found[(b, "f")][1].version == 1
    async with sessions() as s:
        assert await active_functions(s, []) == {}


async def test_kernel_sources_gives_each_tenant_its_own(sessions: async_sessionmaker[AsyncSession]) -> None:
    a, b, none = await tenant_row(sessions), await tenant_row(sessions), await tenant_row(sessions)
    async with sessions() as s:
        await KernelRepository(s, a).add(Kernel(name="k1", source="a1", sha256="a1"))
        await KernelRepository(s, a).add(Kernel(name="k2", source="a2", sha256="a2"))
        await KernelRepository(s, b).add(Kernel(name="k1", source="b1", sha256="b1"))
        await s.commit()
    async with sessions() as s:
        got = await kernel_sources(s, [a, b, none], chunk=2)
        assert got == {a: {"k1": "a1", "k2": "a2"}, b: {"k1": "b1"}, none: {}}
        assert got[a] == await KernelRepository(s, a).sources()
