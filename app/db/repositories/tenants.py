from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import ColumnElement, case, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import Function, FunctionFiles, FunctionVersion, Invocation, Tenant
from app.queue.states import InvocationMode


@dataclass(frozen=True)
class StoredBytes:
    """What a tenant holds in the database against its max_stored_bytes quota."""

    modules: int  # the kept versions of its functions' modules
    async_data: int  # inputs of async invocations not yet run, outputs not yet expired
    files: int = 0  # its functions' file archives

    @property
    def total(self) -> int:
        return self.modules + self.async_data + self.files


class TenantRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def list(self) -> Sequence[Tenant]:
        return (await self.session.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.name))).all()

    async def get(self, tenant_id: str) -> Tenant | None:
        return await self.session.get(Tenant, tenant_id)

    async def get_by_name(self, name: str) -> Tenant | None:
        return await self.session.scalar(select(Tenant).where(Tenant.name == name))

    async def find(self, ref: str) -> Tenant | None:
        """The tenant whose id is `ref`, else the one whose name is `ref` (an id wins: a tenant
        may be named like another's id, never the other way round)."""
        return await self.get(ref) or await self.get_by_name(ref)

    async def add(self, tenant: Tenant) -> Tenant:
        self.session.add(tenant)
        await self.session.flush()
        return tenant

    async def delete(self, tenant: Tenant) -> None:
        await self.session.delete(tenant)
        await self.session.flush()

    async def lock(self, tenant_id: str) -> Tenant | None:
        """Serialize a tenant's writes that check a count or a sum first, across connections and
        nodes, until the transaction ends; returns the tenant as it is now (None: deleted).

        PostgreSQL: a row lock on the tenant (`FOR NO KEY UPDATE`, which leaves the foreign-key
        checks of other tables' inserts free). SQLite: a write to the tenant row as the
        transaction's first statement takes the database's one write lock at once, as
        `BEGIN IMMEDIATE` would (pysqlite's own BEGIN is deferred); reads after it see every
        write committed before it.
        """
        if self.session.get_bind().dialect.name != "postgresql":
            await self.session.execute(
                update(Tenant).where(Tenant.id == tenant_id).values(updated_at=Tenant.updated_at)
            )
            q = select(Tenant).where(Tenant.id == tenant_id)
        else:
            q = select(Tenant).where(Tenant.id == tenant_id).with_for_update(key_share=True)
        return await self.session.scalar(q.execution_options(populate_existing=True))

    async def stored_bytes(self, tenant_id: str, *, except_input_of: str | None = None) -> StoredBytes:
        """Bytes counted against the tenant's max_stored_bytes (lengths only: no value is read).
        `except_input_of`: an invocation whose input is being deleted, whose input is left out."""
        modules = (
            select(func.coalesce(func.sum(FunctionVersion.size), 0))
            .join(Function, Function.id == FunctionVersion.function_id)
            .where(Function.tenant_id == tenant_id)
        )
        stored_input: ColumnElement[int] = func.coalesce(func.length(Invocation.input), 0)
        if except_input_of is not None:
            stored_input = case((Invocation.id == except_input_of, 0), else_=stored_input)
        data = select(
            func.coalesce(func.sum(stored_input + func.coalesce(Invocation.output_bytes, 0)), 0)
        ).where(
            Invocation.tenant_id == tenant_id,
            Invocation.mode == InvocationMode.ASYNC.value,
            or_(Invocation.input.is_not(None), Invocation.output_bytes.is_not(None)),
        )
        files = (
            select(func.coalesce(func.sum(FunctionFiles.size), 0))
            .join(Function, Function.id == FunctionFiles.function_id)
            .where(Function.tenant_id == tenant_id)
        )
        return StoredBytes(
            int(await self.session.scalar(modules) or 0), int(await self.session.scalar(data) or 0),
            int(await self.session.scalar(files) or 0),
        )
