from __future__ import annotations

from datetime import datetime

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from app.api.schemas import QuotaUpdate, TenantCreate, TenantUpdate
from app.db.models import Tenant
from app.db.repositories.functions import FunctionRepository
from app.db.repositories.invocations import InvocationRepository
from app.db.repositories.tenants import TenantRepository
from app.errors import Conflict, NotFound
from app.services.principal import ALL_QUOTA_FIELDS
from app.settings import Settings

DISABLED_REASON = "the tenant was disabled before this invocation started; it was not run"


def default_quota(settings: Settings) -> dict[str, int | float]:
    return {f: getattr(settings, f"default_{f}") for f in ALL_QUOTA_FIELDS}


class TenantService:
    def __init__(self, session: AsyncSession, settings: Settings) -> None:
        self.session = session
        self.settings = settings
        self.repo = TenantRepository(session)

    async def get(self, ref: str) -> Tenant:
        """A tenant by its id or its name (see TenantRepository.find)."""
        tenant = await self.repo.find(ref)
        if tenant is None:
            raise NotFound(f"no tenant with the id or name {ref!r}")
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

    async def update(self, ref: str, body: TenantUpdate, now: datetime) -> Tenant:
        """Disabling a tenant ends its queued async invocations `cancelled` in the same
        transaction: no node claims them after the commit (InvocationRepository.claim skips
        disabled tenants); what runs already may finish. Re-enabling brings nothing back."""
        tenant = await self.get(ref)
        if body.name is not None and body.name != tenant.name:
            if await self.repo.get_by_name(body.name) is not None:
                raise Conflict(f"a tenant named {body.name!r} already exists")
            tenant.name = body.name
        if body.disabled is not None:
            tenant.disabled = body.disabled
        await self.session.flush()
        if body.disabled:
            await InvocationRepository(self.session, tenant.id).cancel_queued_of_tenant(now, DISABLED_REASON)
        return tenant

    async def replace_quota(self, ref: str, body: QuotaUpdate) -> Tenant:
        tenant = await self.get(ref)
        quota = default_quota(self.settings)
        quota.update(body.model_dump(exclude_none=True))
        for field, value in quota.items():
            setattr(tenant, field, value)
        await self.session.flush()
        return tenant

    async def update_quota(self, ref: str, body: QuotaUpdate) -> Tenant:
        """Change only the fields given; the others keep their values."""
        tenant = await self.get(ref)
        for field, value in body.model_dump(exclude_none=True).items():
            setattr(tenant, field, value)
        await self.session.flush()
        return tenant

    async def delete(self, tenant: Tenant) -> set[str]:
        """Delete a tenant with all it owns (its queued invocations go with it, so none runs);
        returns the sha256 of its modules (see drop_unused_artifacts)."""
        shas = await FunctionRepository(self.session, tenant.id).module_shas()
        await self.repo.delete(tenant)
        return shas
