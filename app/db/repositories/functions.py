from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Select, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import Function, FunctionVersion


class FunctionRepository:
    """Functions and their versions, always scoped to one tenant."""

    def __init__(self, session: AsyncSession, tenant_id: str) -> None:
        self.session = session
        self.tenant_id = tenant_id

    def _functions(self) -> Select[Function]:
        return select(Function).where(Function.tenant_id == self.tenant_id)

    async def list(self) -> Sequence[Function]:
        return (await self.session.scalars(self._functions().order_by(Function.name))).all()

    async def get(self, name: str) -> Function | None:
        return await self.session.scalar(self._functions().where(Function.name == name))

    async def count(self) -> int:
        q = select(func.count()).select_from(Function).where(Function.tenant_id == self.tenant_id)
        return int(await self.session.scalar(q) or 0)

    async def add(self, fn: Function) -> Function:
        fn.tenant_id = self.tenant_id
        self.session.add(fn)
        await self.session.flush()
        return fn

    async def add_version(self, version: FunctionVersion) -> FunctionVersion:
        self.session.add(version)
        await self.session.flush()
        return version

    async def version(self, fn: Function, number: int) -> FunctionVersion | None:
        q = select(FunctionVersion).where(
            FunctionVersion.function_id == fn.id, FunctionVersion.version == number
        )
        return await self.session.scalar(q)

    async def version_meta(self, fn: Function, number: int) -> tuple[str, int] | None:
        """(sha256, size) of a version without loading the module bytes."""
        q = select(FunctionVersion.sha256, FunctionVersion.size).where(
            FunctionVersion.function_id == fn.id, FunctionVersion.version == number
        )
        row = (await self.session.execute(q)).first()
        return (row[0], row[1]) if row else None

    async def versions(self, fn: Function) -> Sequence[tuple[int, str, int, object]]:
        q = (
            select(FunctionVersion.version, FunctionVersion.sha256, FunctionVersion.size, FunctionVersion.created_at)
            .where(FunctionVersion.function_id == fn.id)
            .order_by(FunctionVersion.version)
        )
        return [tuple(r) for r in (await self.session.execute(q)).all()]  # type: ignore[misc]

    async def module_bytes(self, fn: Function, number: int) -> bytes | None:
        q = select(FunctionVersion.module).where(
            FunctionVersion.function_id == fn.id, FunctionVersion.version == number
        )
        return await self.session.scalar(q)

    async def delete(self, fn: Function) -> None:
        await self.session.delete(fn)
        await self.session.flush()
