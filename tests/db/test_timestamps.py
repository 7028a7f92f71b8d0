"""Every timestamp comes back from the database as an aware UTC datetime, on SQLite (which keeps
no zone) and on PostgreSQL (which answers in the session's zone)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from sqlalchemy import select, text

from app.db.models import Invocation, Tenant
from app.db.session import create_engine_for, create_sessionmaker


async def test_timestamps_read_back_aware_and_in_utc(database_url: str) -> None:
    engine = create_engine_for(database_url)
    try:
        sessionmaker = create_sessionmaker(engine)
        plus_two = timezone(timedelta(hours=2))
        written = datetime(2026, 5, 1, 14, 30, 15, 123456, tzinfo=plus_two)
        async with sessionmaker() as session:
            if engine.dialect.name == "postgresql":
                await session.execute(text("SET TIME ZONE 'America/New_York'"))  # not UTC on purpose
            tenant = Tenant(
                name="ts-check", gpu_memory_bytes=0, max_concurrency=1, requests_per_second=1.0, max_functions=1,
                max_module_bytes=1024, wasm_memory_bytes=65536, timeout_ms=1000, created_at=written,
            )
            session.add(tenant)
            await session.flush()
            session.add(Invocation(
                id="ts" + "0" * 30, tenant_id=tenant.id, function="f", status="succeeded",
                started_at=datetime(2026, 5, 1, 12, 0), duration_ms=1.0,  # naive: taken as UTC
            ))
            await session.commit()
            session.expunge_all()
            got = await session.scalar(select(Tenant).where(Tenant.name == "ts-check"))
            inv = await session.scalar(select(Invocation).where(Invocation.id == "ts" + "0" * 30))
            assert got is not None and inv is not None
            for value in (got.created_at, got.updated_at, inv.started_at):
                assert value.tzinfo is not None and value.utcoffset() == timedelta(0)
            assert got.created_at == written and got.created_at.hour == 12
            assert inv.started_at == datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
            await session.delete(got)
            await session.commit()
    finally:
        await engine.dispose()
