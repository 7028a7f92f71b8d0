from __future__ import annotations

import builtins
from collections.abc import Iterable, Sequence

from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import defer

from app.db.models import Function, FunctionVersion, Secret


class SecretRepository:
    """A tenant's secrets. Listings never load the sealed values."""

    def __init__(self, session: AsyncSession, tenant_id: str) -> None:
        self.session = session
        self.tenant_id = tenant_id

    async def list(self) -> Sequence[Secret]:
        q = (
            select(Secret).options(defer(Secret.ciphertext, raiseload=True))
            .where(Secret.tenant_id == self.tenant_id).order_by(Secret.name)
        )
        return (await self.session.scalars(q)).all()

    async def get(self, name: str) -> Secret | None:
        return await self.session.scalar(select(Secret).where(Secret.tenant_id == self.tenant_id, Secret.name == name))

    async def usage(self) -> tuple[int, int]:
        """(secrets, bytes of their values)."""
        q = select(func.count(), func.coalesce(func.sum(Secret.size), 0)).where(Secret.tenant_id == self.tenant_id)
        count, size = (await self.session.execute(q)).one()
        return int(count), int(size)

    async def add(self, secret: Secret) -> Secret:
        secret.tenant_id = self.tenant_id
        self.session.add(secret)
        await self.session.flush()
        return secret

    async def delete(self, name: str) -> None:
        await self.session.execute(delete(Secret).where(Secret.tenant_id == self.tenant_id, Secret.name == name))

    async def existing(self, names: Iterable[str]) -> builtins.set[str]:
        wanted = list(names)
        if not wanted:
            return set()
        q = select(Secret.name).where(Secret.tenant_id == self.tenant_id, Secret.name.in_(wanted))
        return set((await self.session.scalars(q)).all())

    async def sealed(self, names: Iterable[str]) -> dict[str, bytes]:
        """The sealed values of these secrets (those that exist)."""
        wanted = list(names)
        if not wanted:
            return {}
        q = select(Secret.name, Secret.ciphertext).where(Secret.tenant_id == self.tenant_id, Secret.name.in_(wanted))
        return {n: c for n, c in (await self.session.execute(q)).all()}

    async def users(self, name: str) -> builtins.list[str]:
        """The functions whose active version gets this secret. JSON arrays are compared in
        Python: SQLite and PostgreSQL have no common containment operator."""
        q = select(Function.name, Function.secrets).where(Function.tenant_id == self.tenant_id).order_by(Function.name)
        return [n for n, names in (await self.session.execute(q)).all() if name in (names or ())]

    async def referencing(self, name: str) -> builtins.list[str]:
        """The functions with a kept version, active or not, that gets this secret."""
        q = (
            select(Function.name, FunctionVersion.secrets).join(FunctionVersion, FunctionVersion.function_id == Function.id)
            .where(Function.tenant_id == self.tenant_id)
        )
        return sorted({n for n, names in (await self.session.execute(q)).all() if name in (names or ())})
