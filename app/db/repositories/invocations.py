from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import Invocation


class InvocationRepository:
    def __init__(self, session: AsyncSession, tenant_id: str | None = None) -> None:
        self.session = session
        self.tenant_id = tenant_id

    async def get(self, invocation_id: str) -> Invocation | None:
        q = select(Invocation).where(Invocation.id == invocation_id, Invocation.tenant_id == self.tenant_id)
        return await self.session.scalar(q)

    async def list(self, function: str | None, limit: int) -> Sequence[Invocation]:
        q = select(Invocation).where(Invocation.tenant_id == self.tenant_id)
        if function is not None:
            q = q.where(Invocation.function == function)
        q = q.order_by(Invocation.started_at.desc(), Invocation.id).limit(limit)
        return (await self.session.scalars(q)).all()

    async def insert_many(self, rows: list[dict[str, Any]]) -> None:
        """Batch insert from the recorder (rows already carry their tenant_id)."""
        if rows:
            # Core executemany: the ORM bulk path costs ~10x more per row
            await self.session.execute(insert(Invocation.__table__), rows)
