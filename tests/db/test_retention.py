"""What the sweep deletes (InvocationRepository.expire_outputs, delete_ended_before), on SQLite
and PostgreSQL: outputs and stderr tails after the output retention, records after theirs."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.models import Invocation, InvocationOutput
from app.db.repositories.invocations import InvocationRepository
from tests.db.helpers import sessionmaker_for, tenant_row

LONG_AGO = datetime(2001, 1, 1, tzinfo=UTC)  # before anything another test writes


@pytest.fixture
async def sessions(database_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    async with sessionmaker_for(database_url) as sm:
        yield sm


async def _record(sm: async_sessionmaker[AsyncSession], tid: str, mode: str, ended: datetime) -> str:
    iid = uuid.uuid4().hex
    async with sm() as s:
        await InvocationRepository(s).add(Invocation(
            id=iid, tenant_id=tid, function="f", mode=mode, status="guest_error", created_at=ended, ended_at=ended,
            error="trap", stderr_tail="x" * 1000, output_bytes=3 if mode == "async" else None,
        ))
        if mode == "async":
            s.add(InvocationOutput(invocation_id=iid, idx=0, data=b"out"))
        await s.commit()
    return iid


async def test_stderr_tails_go_with_outputs_and_records_after_their_own_retention(sessions: async_sessionmaker[AsyncSession]) -> None:
    tid = await tenant_row(sessions)
    old_sync = await _record(sessions, tid, "sync", LONG_AGO)
    old_async = await _record(sessions, tid, "async", LONG_AGO)
    newer = await _record(sessions, tid, "sync", LONG_AGO + timedelta(days=2))
    async with sessions() as s:
        await InvocationRepository(s).expire_outputs(LONG_AGO + timedelta(days=1))
        await s.commit()
    async with sessions() as s:
        a, b, c = [await s.get(Invocation, i) for i in (old_sync, old_async, newer)]
        assert a is not None and b is not None and c is not None
        assert (a.stderr_tail, b.stderr_tail, b.output_bytes, a.error) == (None, None, None, "trap")  # the record stays
        assert (await s.scalars(select(InvocationOutput).where(InvocationOutput.invocation_id == old_async))).all() == []
        assert c.stderr_tail == "x" * 1000
    async with sessions() as s:
        assert await InvocationRepository(s).delete_ended_before(LONG_AGO + timedelta(days=1)) == 2
        await s.commit()
    async with sessions() as s:
        assert await s.get(Invocation, old_sync) is None and await s.get(Invocation, old_async) is None
        assert await s.get(Invocation, newer) is not None
