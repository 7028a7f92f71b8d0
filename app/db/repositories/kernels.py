from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import Kernel


class KernelRepository:
    """Tenant-registered CUDA kernel modules, always scoped to one tenant."""

    def __init__(self, session: AsyncSession, tenant_id: str) -> None:
        self.session = session
        self.tenant_id = tenant_id

    async def list(self) -> Sequence[Kernel]:
        q = select(Kernel).where(Kernel.tenant_id == self.tenant_id).order_by(Kernel.name)
        return (await self.session.scalars(q)).all()

    async def get(self, name: str) -> Kernel | None:
        q = select(Kernel).where(Kernel.tenant_id == self.tenant_id, Kernel.name == name)
        return await self.session.scalar(q)

    async def count(self) -> int:
        q = select(func.count()).select_from(Kernel).where(Kernel.tenant_id == self.tenant_id)
        return int(await self.session.scalar(q) or 0)

    async def sources(self) -> dict[str, str]:
        q = select(Kernel.name, Kernel.source).where(Kernel.tenant_id == self.tenant_id)
        return {n: s for n, s in (await self.session.execute(q)).all()}

    async def add(self, kernel: Kernel) -> Kernel:
        kernel.tenant_id = self.tenant_id
        self.session.add(kernel)
        await self.session.flush()
        return kernel

    async def delete(self, kernel: Kernel) -> None:
        await self.session.delete(kernel)
        await self.session.flush()


async def kernel_sources(session: AsyncSession, tenant_ids: Sequence[str], chunk: int = 500) -> dict[str, dict[str, str]]:
    """`KernelRepository.sources` of each of these tenants (each present, {} for none), in one
    query per `chunk` tenants: a front's cache refresh."""
    out: dict[str, dict[str, str]] = {t: {} for t in tenant_ids}
    for i in range(0, len(tenant_ids), chunk):
        q = select(Kernel.tenant_id, Kernel.name, Kernel.source).where(Kernel.tenant_id.in_(tenant_ids[i : i + chunk]))
        for tenant_id, name, source in (await session.execute(q)).all():
            out[tenant_id][name] = source
    return out
