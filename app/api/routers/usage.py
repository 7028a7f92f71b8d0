from __future__ import annotations

import msgspec
from fastapi import APIRouter

from app.api.deps import PlatformDep, SessionDep, TenantDep
from app.api.errors import error_responses
from app.api.schemas import Quota, UsageOut
from app.db.repositories.functions import FunctionRepository
from app.db.repositories.invocations import InvocationRepository
from app.db.repositories.kernels import KernelRepository
from app.db.repositories.tenants import TenantRepository
from app.queue.states import InvocationStatus
from app.services.principal import public_quota

router = APIRouter(prefix="/v1/usage", tags=["usage"])


@router.get("", operation_id="get_usage", response_model=UsageOut, responses=error_responses(401, 403))
async def get_usage(tenant: TenantDep, session: SessionDep, platform: PlatformDep) -> UsageOut:
    live = msgspec.structs.asdict(await platform.node.usage(tenant.id))
    invocations = InvocationRepository(session, tenant.id)
    stored = await TenantRepository(session).stored_bytes(tenant.id)
    return UsageOut(
        tenant=tenant.name,
        quota=Quota.model_validate(public_quota(tenant.quota)),
        functions=await FunctionRepository(session, tenant.id).count(),
        kernels=await KernelRepository(session, tenant.id).count(),
        async_queued=await invocations.count_async(InvocationStatus.QUEUED),
        async_running=await invocations.count_async(InvocationStatus.RUNNING),
        stored_bytes=stored.total,
        stored_module_bytes=stored.modules,
        stored_files_bytes=stored.files,
        stored_async_bytes=stored.async_data,
        **live,
    )
