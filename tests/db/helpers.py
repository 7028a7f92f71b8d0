"""What the repository tests share: a sessionmaker on the suite's database and a tenant row."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.models import Tenant
from app.db.session import create_engine_for, create_sessionmaker


@asynccontextmanager
async def sessionmaker_for(database_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_engine_for(database_url)
    try:
        yield create_sessionmaker(engine)
    finally:
        await engine.dispose()


async def tenant_row(sm: async_sessionmaker[AsyncSession], **values: object) -> str:
    tid = uuid.uuid4().hex
    async with sm() as s:
        s.add(Tenant(id=tid, name=f"w-{tid[:12]}", gpu_memory_bytes=0, max_concurrency=1, requests_per_second=1.0,
                     max_functions=10, max_module_bytes=1 << 20, wasm_memory_bytes=65536, timeout_ms=1000, **values))
        await s.commit()
    return tid
