"""Function logs: the stderr of calls, per tenant within a byte budget (app/services/logs.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, func, insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import FunctionLog


async def append(session: AsyncSession, rows: list[dict[str, Any]]) -> None:
    """Insert log rows (each carries its tenant_id) in the caller's transaction."""
    if rows:
        await session.execute(insert(FunctionLog), rows)


async def prune(session: AsyncSession, tenant_id: str, budget: int) -> int:
    """Delete a tenant's oldest rows until the rest fit `budget` bytes; returns the rows deleted.
    One statement: a running sum from the newest row finds the newest one past the budget."""
    running = func.sum(FunctionLog.size).over(order_by=FunctionLog.id.desc()).label("running")
    sums = select(FunctionLog.id, running).where(FunctionLog.tenant_id == tenant_id).subquery()
    cutoff = select(func.max(sums.c.id)).where(sums.c.running > budget).scalar_subquery()
    result = await session.execute(delete(FunctionLog).where(FunctionLog.tenant_id == tenant_id, FunctionLog.id <= cutoff))
    return int(getattr(result, "rowcount", 0) or 0)


class LogRepository:
    """One tenant's function logs."""

    def __init__(self, session: AsyncSession, tenant_id: str) -> None:
        self.session = session
        self.tenant_id = tenant_id

    async def newest(self, function: str, limit: int) -> Sequence[FunctionLog]:
        """The `limit` newest calls' rows of a function, oldest first."""
        q = (
            select(FunctionLog).where(FunctionLog.tenant_id == self.tenant_id, FunctionLog.function == function)
            .order_by(FunctionLog.id.desc()).limit(limit)
        )
        return list(reversed((await self.session.scalars(q)).all()))

    async def after(self, function: str, after_id: int, limit: int) -> Sequence[FunctionLog]:
        """Rows of a function past `after_id`, oldest first (the index on tenant, function, id answers it)."""
        q = (
            select(FunctionLog)
            .where(FunctionLog.tenant_id == self.tenant_id, FunctionLog.function == function, FunctionLog.id > after_id)
            .order_by(FunctionLog.id).limit(limit)
        )
        return (await self.session.scalars(q)).all()
