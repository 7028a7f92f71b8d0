from __future__ import annotations

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from app.api.schemas import QuotaUpdate, TenantCreate, TenantUpdate
from app.db.models import Tenant
from app.db.repositories.tenants import TenantRepository
from app.errors import Conflict, NotFound
from app.services.principal import QUOTA_FIELDS
from app.settings import Settings


def default_quota(settings: Settings) -> dict[str, int | float]:
    return {f: getattr(settings, f"default_{f}") for f in QUOTA_FIELDS}


class TenantService:
    def __init__(self, session: AsyncSession, settings: Settings) -> None:
        self.session = session
        self.settings = settings
        self.repo = TenantRepository(session)

    async def get(self, tenant_id: str) -> Tenant:
        tenant = await self.repo.get(tenant_id)
        if tenant is None:
            raise NotFound.of("tenant")
        return tenant

    async def create(self, body: TenantCreate) -> Tenant:
        if await self.repo.get_by_name(body.name) is not None:
            raise Conflict(f"a tenant named {body.name!r} already exists")
        quota = default_quota(self.settings)
        if body.quota is not None:
            quota.update(body.quota.model_dump(exclude_none=True))
        try:
            return await self.repo.add(Tenant(name=body.name, **quota))
        except IntegrityError:
            raise Conflict(f"a tenant named {body.name!r} already exists") from None

    async def update(self, tenant_id: str, body: TenantUpdate) -> Tenant:
        tenant = await self.get(tenant_id)
        if body.name is not None and body.name != tenant.name:
            if await self.repo.get_by_name(body.name) is not None:
                raise Conflict(f"a tenant named {body.name!r} already exists")
            tenant.name = body.name
        if body.disabled is not None:
            tenant.disabled = body.disabled
        await self.session.flush()
        return tenant

    async def replace_quota(self, tenant_id: str, body: QuotaUpdate) -> Tenant:
        tenant = await self.get(tenant_id)
        quota = default_quota(self.settings)
        quota.update(body.model_dump(exclude_none=True))
        for field, value in quota.items():
            setattr(tenant, field, value)
        await self.session.flush()
        return tenant

    async def update_quota(self, tenant_id: str, body: QuotaUpdate) -> Tenant:
        """Change only the fields given; the others keep their values."""
        tenant = await self.get(tenant_id)
        for field, value in body.model_dump(exclude_none=True).items():
            setattr(tenant, field, value)
        await self.session.flush()
        return tenant

    async def delete(self, tenant_id: str) -> None:
        await self.repo.delete(await self.get(tenant_id))
