from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import ApiKey, Tenant


class ApiKeyRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def list_for_tenant(self, tenant_id: str) -> Sequence[ApiKey]:
        q = select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at)
        return (await self.session.scalars(q)).all()

    async def get_for_tenant(self, tenant_id: str, key_id: str) -> ApiKey | None:
        q = select(ApiKey).where(ApiKey.tenant_id == tenant_id, ApiKey.id == key_id)
        return await self.session.scalar(q)

    async def add(self, key: ApiKey) -> ApiKey:
        self.session.add(key)
        await self.session.flush()
        return key

    async def active_candidates(self, prefix: str) -> Sequence[tuple[ApiKey, Tenant]]:
        """Unrevoked keys with this prefix, with their tenant (which may be disabled)."""
        q = (
            select(ApiKey, Tenant)
            .join(Tenant, Tenant.id == ApiKey.tenant_id)
            .where(ApiKey.prefix == prefix, ApiKey.revoked_at.is_(None))
        )
        return [(k, t) for k, t in (await self.session.execute(q)).all()]

    async def active_tenants(self, key_ids: Sequence[str]) -> dict[str, Tenant]:
        """key id -> its tenant, for the keys that are still unrevoked and whose tenant is enabled."""
        if not key_ids:
            return {}
        q = (
            select(ApiKey.id, Tenant)
            .join(Tenant, Tenant.id == ApiKey.tenant_id)
            .where(ApiKey.id.in_(list(key_ids)), ApiKey.revoked_at.is_(None), Tenant.disabled.is_(False))
        )
        return {key_id: tenant for key_id, tenant in (await self.session.execute(q)).all()}

    async def touch(self, key_id: str, when: datetime) -> None:
        await self.session.execute(update(ApiKey).where(ApiKey.id == key_id).values(last_used_at=when))
