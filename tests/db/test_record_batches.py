"""Record batches (app/db/repositories/record_batches.py) store what SQLAlchemy's own INSERT
stores, column for column, on the database the suite runs on (SQLite, or PostgreSQL in CI)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, cast

from sqlalchemy import Table, insert, select, text

from app.db.models import Invocation, Tenant
from app.db.repositories.invocations import InvocationRepository
from app.db.repositories.record_batches import record_batch
from app.db.session import create_engine_for, create_sessionmaker

_NOW = datetime(2026, 11, 27, 12, 0, 0, 123456, tzinfo=UTC)


def _shapes(tenant_id: str) -> list[dict[str, Any]]:
    """Rows as the recorder makes them: a synchronous call's, a streamed one's (more columns),
    times naive, in another zone and on a whole second, and one with a JSON column."""
    sync = {"tenant_id": tenant_id, "function": "f", "version": 1, "created_at": _NOW, "started_at": _NOW, "status": "succeeded",
            "duration_ms": 1.5, "exit_code": 0, "error": None, "stderr_tail": "line\n"}
    stream = {"tenant_id": tenant_id, "function": "g", "mode": "stream", "version": 2, "status": "cancelled", "created_at": _NOW,
              "started_at": _NOW.replace(tzinfo=None), "ended_at": _NOW.astimezone(timezone(timedelta(hours=-5))).replace(microsecond=0),
              "duration_ms": 2.0, "exit_code": None, "error": "gone", "stderr_tail": None}
    with_json = {**sync, "args": ["a", "b"]}
    return [sync, stream, with_json]


async def test_a_batch_stores_what_sqlalchemy_stores(database_url: str) -> None:
    engine = create_engine_for(database_url)
    sm = create_sessionmaker(engine)
    tid = uuid.uuid4().hex
    async with sm() as s:
        s.add(Tenant(id=tid, name=f"batch-{tid[:8]}", gpu_memory_bytes=0, max_concurrency=1, requests_per_second=1.0,
                     max_functions=1, max_module_bytes=8, wasm_memory_bytes=65536, timeout_ms=1, max_queued=1))
        await s.commit()
    ours = [{**row, "id": uuid.uuid4().hex} for row in _shapes(tid)]
    theirs = [{**row, "id": uuid.uuid4().hex} for row in _shapes(tid)]
    batch = record_batch(ours, engine.dialect)
    assert len(batch.statements) == 2 and len(batch.other) == 1  # the JSON row goes SQLAlchemy's way
    async with sm() as s:
        await InvocationRepository(s).insert_batch(batch)
        for row in theirs:
            await s.execute(insert(cast(Table, Invocation.__table__)), [row])
        await s.commit()
    columns = [c.name for c in cast(Table, Invocation.__table__).columns if c.name != "id"]
    async with sm() as s:
        for mine, other in zip(ours, theirs, strict=True):
            # as stored (SQLite keeps times as text: the same text), and as the ORM reads them
            stored = [
                (await s.execute(text(f"SELECT {', '.join(columns)} FROM invocations WHERE id = :id"), {"id": i})).one()
                for i in (mine["id"], other["id"])
            ]
            assert stored[0] == stored[1]
            read = [(await s.execute(select(Invocation).where(Invocation.id == i))).scalar_one() for i in (mine["id"], other["id"])]
            assert [getattr(read[0], c) for c in columns] == [getattr(read[1], c) for c in columns]
            assert read[0].started_at == _NOW and read[0].created_at == _NOW
    await engine.dispose()


def test_batches_built_in_pieces_join_one_statement_per_shape() -> None:
    from sqlalchemy.dialects import sqlite

    from app.db.repositories.record_batches import RecordBatch

    now = datetime.now(UTC)
    sync = {"id": "a", "tenant_id": "t", "function": "f", "created_at": now, "status": "succeeded"}
    other = {"id": "b", "tenant_id": "t", "function": "f", "created_at": now}
    dialect = sqlite.dialect(paramstyle="qmark")
    whole = RecordBatch()
    for piece in ([sync, other], [{**sync, "id": "c"}], [{**other, "id": "d"}, {**sync, "id": "e"}]):
        whole.extend(record_batch(piece, dialect))
    assert [len(values) for _sql, values in whole.statements] == [3, 2]
    assert [v[0] for v in whole.statements[0][1]] == ["a", "c", "e"]
    assert whole.statements == record_batch([sync, {**sync, "id": "c"}, {**sync, "id": "e"}, other, {**other, "id": "d"}], dialect).statements


def test_a_shape_is_worked_out_once_per_dialect() -> None:
    from sqlalchemy.dialects import postgresql, sqlite

    from app.db.repositories.record_batches import _shape

    now = datetime.now(UTC)
    row = {"id": "a", "tenant_id": "t", "function": "f", "created_at": now, "status": "succeeded"}
    lite, pg = sqlite.dialect(paramstyle="qmark"), postgresql.dialect(paramstyle="format")
    first = record_batch([row], lite).statements[0][0]
    hits = _shape.cache_info().hits
    again = record_batch([{**row, "id": "b"}, {**row, "id": "c"}], lite).statements[0][0]
    assert again is first and _shape.cache_info().hits == hits + 1  # the same statement, not built again
    elsewhere = record_batch([row], pg).statements[0][0]
    assert "?" in first and "%s" in elsewhere and "?" not in elsewhere  # each dialect its own
