from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import UTC, datetime

import pytest

from app.db.repositories.invocations import InvocationRepository
from app.services.records import InvocationRecorder
from tests.helpers import new_tenant


async def test_a_record_of_a_deleted_tenant_does_not_block_the_batch(client, platform) -> None:
    tid, _ = await new_tenant(client)
    rec = InvocationRecorder(platform.sessionmaker, 60, 1000)
    now = datetime.now(UTC)
    base = {"function": "f", "version": 1, "status": "succeeded", "started_at": now, "duration_ms": 1.0, "exit_code": 0, "error": None, "stderr_tail": None}
    rec.record({**base, "id": "a" * 32, "tenant_id": tid})
    rec.record({**base, "id": "b" * 32, "tenant_id": "gone-tenant"})
    await rec.flush()
    assert rec.dropped == 1 and not rec._pending
    from app.db.repositories.invocations import InvocationRepository

    async with platform.sessionmaker() as s:
        assert (await InvocationRepository(s, tid).get("a" * 32)) is not None


async def test_stop_lets_a_flush_in_progress_finish_and_loses_no_record(client, platform, monkeypatch) -> None:
    import asyncio

    from app.db.repositories.invocations import InvocationRepository

    tid, _ = await new_tenant(client)
    entered = asyncio.Event()
    slow_insert = InvocationRepository.insert_batch

    async def insert_batch(self, batch):  # type: ignore[no-untyped-def]
        entered.set()
        await asyncio.sleep(0.2)  # stop() arrives while this write is in flight
        return await slow_insert(self, batch)

    monkeypatch.setattr(InvocationRepository, "insert_batch", insert_batch)
    rec = InvocationRecorder(platform.sessionmaker, 0.01, 1000)
    rec.start()
    now = datetime.now(UTC)
    base = {"function": "f", "version": 1, "status": "succeeded", "started_at": now, "duration_ms": 1.0, "exit_code": 0, "error": None, "stderr_tail": None}
    ids = [f"{i:032x}" for i in range(5)]
    for i in ids[:3]:
        rec.record({**base, "id": i, "tenant_id": tid})
    await asyncio.wait_for(entered.wait(), 5)
    for i in ids[3:]:  # arrive during the flush: the final flush writes them
        rec.record({**base, "id": i, "tenant_id": tid})
    await rec.stop()
    async with platform.sessionmaker() as s:
        repo = InvocationRepository(s, tid)
        assert [await repo.get(i) is not None for i in ids] == [True] * 5


async def test_records_of_different_shapes_in_one_batch(database_url: str) -> None:
    """Synchronous and streamed call records carry different columns and share a batch."""
    from datetime import datetime

    from app.db.models import Tenant
    from app.db.repositories.invocations import InvocationRepository
    from app.db.session import create_engine_for, create_sessionmaker

    engine = create_engine_for(database_url)
    sm = create_sessionmaker(engine)
    now = datetime.now(UTC)
    tid = uuid.uuid4().hex
    async with sm() as s:
        s.add(Tenant(id=tid, name=f"shapes-{tid[:8]}", gpu_memory_bytes=0, max_concurrency=1, requests_per_second=1.0,
                     max_functions=1, max_module_bytes=8, wasm_memory_bytes=65536, timeout_ms=1, max_queued=1))
        await s.commit()
    rec = InvocationRecorder(sm, 1.0, 100)
    sync_id, stream_id = uuid.uuid4().hex, uuid.uuid4().hex
    rec.record({"id": sync_id, "tenant_id": tid, "function": "f", "version": 1, "created_at": now, "started_at": now,
                "exit_code": 0, "stderr_tail": None, "status": "succeeded", "duration_ms": 1.0, "error": None})
    rec.record({"id": stream_id, "tenant_id": tid, "function": "f", "mode": "stream", "version": 1, "status": "cancelled",
                "created_at": now, "started_at": now, "ended_at": now, "duration_ms": 2.0, "exit_code": None,
                "error": "gone", "stderr_tail": None})
    await rec.flush()
    async with sm() as s:
        repo = InvocationRepository(s, tid)
        assert (await repo.get(sync_id)).mode == "sync"
        assert (await repo.get(stream_id)).mode == "stream"
    await engine.dispose()


async def test_a_backlog_is_built_in_pieces_and_written_in_one_transaction(client, platform, monkeypatch) -> None:
    """A batch has its values built a piece at a time (records._CHUNK rows), the front's loop
    free between pieces; the pieces join one statement per shape of row, and every row lands in
    one commit."""
    from app.db.repositories.invocations import InvocationRepository
    from app.services import records

    tid, _ = await new_tenant(client)
    pieces: list[int] = []
    real_build = records.record_batch

    def record_batch(rows, dialect):  # type: ignore[no-untyped-def]
        pieces.append(len(rows))
        return real_build(rows, dialect)

    monkeypatch.setattr(records, "record_batch", record_batch)
    commits = 0
    real_write = InvocationRecorder._write

    statements: list[int] = []

    async def write(self, touched, rows, batch, landed):  # type: ignore[no-untyped-def]
        nonlocal commits
        commits += 1
        statements.extend(len(values) for _sql, values in batch.statements)
        return await real_write(self, touched, rows, batch, landed)

    monkeypatch.setattr(InvocationRecorder, "_write", write)
    rec = InvocationRecorder(platform.sessionmaker, 60, 10_000)
    now = datetime.now(UTC)
    base = {"function": "f", "version": 1, "status": "succeeded", "started_at": now, "duration_ms": 1.0, "exit_code": 0, "error": None, "stderr_tail": None}
    ids = [uuid.uuid4().hex for _ in range(1200)]
    for i in ids:
        rec.record({**base, "id": i, "created_at": now, "tenant_id": tid})
    await rec.flush()
    assert pieces == [records._CHUNK] * (1200 // records._CHUNK) and commits == 1 and not rec._pending
    assert statements == [1200]  # one executemany
    async with platform.sessionmaker() as s:
        repo = InvocationRepository(s, tid)
        assert all([await repo.get(i) is not None for i in ids])


async def test_stop_tries_again_when_the_last_write_fails(client, platform, monkeypatch) -> None:
    """A database busy at shutdown (SQLite's lock, held past its wait by other fronts' last
    batches) fails the last flush: the recorder tries again within STOP_FLUSH_S, losing nothing."""
    from sqlalchemy.exc import OperationalError

    from app.db.repositories.invocations import InvocationRepository

    tid, _ = await new_tenant(client)
    real = InvocationRepository.insert_batch
    failures = 2

    async def insert_batch(self, batch):  # type: ignore[no-untyped-def]
        nonlocal failures
        if failures:
            failures -= 1
            raise OperationalError("INSERT", {}, Exception("database is locked"))
        return await real(self, batch)

    monkeypatch.setattr(InvocationRepository, "insert_batch", insert_batch)
    rec = InvocationRecorder(platform.sessionmaker, 60, 1000)
    now = datetime.now(UTC)
    ids = [uuid.uuid4().hex for _ in range(3)]  # the database is the session's: ids of their own
    for i in ids:
        rec.record({"id": i, "tenant_id": tid, "function": "f", "version": 1, "status": "succeeded", "started_at": now,
                    "duration_ms": 1.0, "exit_code": 0, "error": None, "stderr_tail": None})
    await rec.stop()
    assert failures == 0 and rec.dropped == 0
    async with platform.sessionmaker() as s:
        repo = InvocationRepository(s, tid)
        assert [await repo.get(i) is not None for i in ids] == [True] * 3


async def test_stop_gives_up_within_its_bound_and_counts_what_it_lost(client, platform, monkeypatch, caplog) -> None:
    from sqlalchemy.exc import OperationalError

    from app.db.repositories.invocations import InvocationRepository
    from app.services import records

    tid, _ = await new_tenant(client)

    async def insert_batch(self, batch):  # type: ignore[no-untyped-def]
        raise OperationalError("INSERT", {}, Exception("database is locked"))

    monkeypatch.setattr(InvocationRepository, "insert_batch", insert_batch)
    monkeypatch.setattr(records, "STOP_FLUSH_S", 0.3)
    rec = InvocationRecorder(platform.sessionmaker, 60, 1000)
    now = datetime.now(UTC)
    for _ in range(4):
        rec.record({"id": uuid.uuid4().hex, "tenant_id": tid, "function": "f", "version": 1, "status": "succeeded", "started_at": now,
                    "duration_ms": 1.0, "exit_code": 0, "error": None, "stderr_tail": None})
    await asyncio.wait_for(rec.stop(), 5)  # returns, does not raise: the process stops cleanly
    assert rec.dropped == 4 and not rec._pending
    assert "4 invocation records could not be written" in caplog.text


async def test_rows_are_kept_when_the_write_fails_before_they_are_sent(client, platform) -> None:
    """A failure outside the INSERT itself (the turn not given, a key's last use not written)
    keeps the rows for the next flush: none is lost."""
    tid, _ = await new_tenant(client)

    class NoTurn:
        async def __aenter__(self) -> None:
            raise OSError("no turn")

        async def __aexit__(self, *_: object) -> None:
            return None

    rec = InvocationRecorder(platform.sessionmaker, 60, 1000, turn=NoTurn())  # type: ignore[arg-type]
    now = datetime.now(UTC)
    ids = [uuid.uuid4().hex for _ in range(3)]
    for i in ids:
        rec.record({"id": i, "tenant_id": tid, "function": "f", "version": 1, "status": "succeeded", "created_at": now, "started_at": now,
                    "duration_ms": 1.0, "exit_code": 0, "error": None, "stderr_tail": None})
    with pytest.raises(OSError, match="no turn"):
        await rec.flush()
    assert [r["id"] for r in rec._pending] == ids and rec.dropped == 0


async def test_a_flush_that_fails_after_its_commit_queues_nothing_again(client, platform, caplog) -> None:
    """A flush cancelled once its rows are committed (a stop's wait ran out) keeps none of them
    for the next try; a row written twice all the same is found written, not counted lost."""
    tid, _ = await new_tenant(client)

    class CancelledAfter:
        async def __aenter__(self) -> None:
            return None

        async def __aexit__(self, *_: object) -> None:
            raise asyncio.CancelledError  # after the write and its commit

    now = datetime.now(UTC)

    def row(i: str) -> dict:
        return {"id": i, "tenant_id": tid, "function": "f", "version": 1, "status": "succeeded", "created_at": now, "started_at": now,
                "duration_ms": 1.0, "exit_code": 0, "error": None, "stderr_tail": None}

    rec = InvocationRecorder(platform.sessionmaker, 60, 1000, turn=CancelledAfter())  # type: ignore[arg-type]
    first = [uuid.uuid4().hex for _ in range(3)]
    for i in first:
        rec.record(row(i))
    with pytest.raises(asyncio.CancelledError):
        await rec.flush()
    assert rec._pending == [] and rec.dropped == 0

    again = InvocationRecorder(platform.sessionmaker, 60, 1000)
    fresh = uuid.uuid4().hex
    again.record(row(first[0]))  # as a flush cancelled before the fix above would have kept it
    again.record(row(fresh))
    with caplog.at_level(logging.INFO):
        await again.flush()
    assert again.dropped == 0 and again._pending == []
    assert "no longer exists" not in caplog.text
    async with platform.sessionmaker() as s:
        repo = InvocationRepository(s, tid)
        assert [await repo.get(i) is not None for i in [*first, fresh]] == [True] * 4
