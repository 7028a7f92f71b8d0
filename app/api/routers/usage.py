from __future__ import annotations

import msgspec
from fastapi import APIRouter

from app.api.deps import PlatformDep, SessionDep, TenantDep
from app.api.schemas import Quota, UsageOut
from app.db.repositories.functions import FunctionRepository
from app.db.repositories.kernels import KernelRepository

router = APIRouter(prefix="/v1/usage", tags=["usage"])


@router.get("", operation_id="get_usage", response_model=UsageOut)
async def get_usage(tenant: TenantDep, session: SessionDep, platform: PlatformDep) -> UsageOut:
    live = msgspec.structs.asdict(await platform.node.usage(tenant.id))
    return UsageOut(
        tenant=tenant.name,
        quota=Quota(**tenant.quota.as_dict()),
        functions=await FunctionRepository(session, tenant.id).count(),
        kernels=await KernelRepository(session, tenant.id).count(),
        **live,
    )
