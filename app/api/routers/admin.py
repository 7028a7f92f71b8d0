from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path, Response

from app.api.body import LimitedBodyRoute
from app.api.deps import AdminDep, PlatformDep, SessionDep
from app.api.errors import error_responses
from app.api.schemas import ID_PATTERN, ApiKeyCreated, ApiKeyOut, Quota, QuotaUpdate, TenantCreate, TenantOut, TenantUpdate, WorkerOut
from app.contract.messages import ChangeKind
from app.db.models import Tenant
from app.services.api_keys import ApiKeyService
from app.services.principal import TenantQuota
from app.services.tenants import TenantService

router = APIRouter(prefix="/v1/admin", tags=["admin"], dependencies=[AdminDep], route_class=LimitedBodyRoute)

TenantId = Annotated[str, Path(pattern=ID_PATTERN, description="the tenant's id")]
KeyId = Annotated[str, Path(pattern=ID_PATTERN, description="the key's id")]
# every admin route: no or a wrong token (401), a tenant key (403)
_AUTH = (401, 403)
_BODY = (400, 413, 422)  # JSON bodies: bad Content-Length, over TENSORWASM_MAX_JSON_BYTES, invalid


def tenant_out(t: Tenant) -> TenantOut:
    return TenantOut(
        id=t.id,
        name=t.name,
        disabled=t.disabled,
        quota=Quota.model_validate(TenantQuota.of(t).as_dict()),
        created_at=t.created_at,
        updated_at=t.updated_at,
    )


@router.post("/tenants", status_code=201, operation_id="create_tenant", response_model=TenantOut, responses=error_responses(*_AUTH, *_BODY, 409))
async def create_tenant(body: TenantCreate, session: SessionDep, platform: PlatformDep) -> TenantOut:
    tenant = await TenantService(session, platform.settings).create(body)
    await session.commit()
    return tenant_out(tenant)


@router.get("/tenants", operation_id="list_tenants", response_model=list[TenantOut], responses=error_responses(*_AUTH))
async def list_tenants(session: SessionDep, platform: PlatformDep) -> list[TenantOut]:
    return [tenant_out(t) for t in await TenantService(session, platform.settings).repo.list()]


@router.get("/tenants/{tenant_id}", operation_id="get_tenant", response_model=TenantOut, responses=error_responses(*_AUTH, 404, 422))
async def get_tenant(tenant_id: TenantId, session: SessionDep, platform: PlatformDep) -> TenantOut:
    return tenant_out(await TenantService(session, platform.settings).get(tenant_id))


@router.patch("/tenants/{tenant_id}", operation_id="update_tenant", response_model=TenantOut, responses=error_responses(*_AUTH, *_BODY, 404, 409))
async def update_tenant(tenant_id: TenantId, body: TenantUpdate, session: SessionDep, platform: PlatformDep) -> TenantOut:
    tenant = await TenantService(session, platform.settings).update(tenant_id, body)
    await session.commit()
    await platform.tenant_changed(tenant_id)
    return tenant_out(tenant)


@router.delete("/tenants/{tenant_id}", status_code=204, operation_id="delete_tenant", responses=error_responses(*_AUTH, 404, 422))
async def delete_tenant(tenant_id: TenantId, session: SessionDep, platform: PlatformDep) -> Response:
    await platform.recorder.flush()  # its pending records reference the tenant
    await TenantService(session, platform.settings).delete(tenant_id)
    await session.commit()
    await platform.tenant_changed(tenant_id)
    return Response(status_code=204)


@router.get("/tenants/{tenant_id}/quota", operation_id="get_quota", response_model=Quota, responses=error_responses(*_AUTH, 404, 422))
async def get_quota(tenant_id: TenantId, session: SessionDep, platform: PlatformDep) -> Quota:
    return tenant_out(await TenantService(session, platform.settings).get(tenant_id)).quota


@router.put("/tenants/{tenant_id}/quota", operation_id="replace_quota", response_model=Quota, responses=error_responses(*_AUTH, *_BODY, 404))
async def replace_quota(tenant_id: TenantId, body: QuotaUpdate, session: SessionDep, platform: PlatformDep) -> Quota:
    """Replace the whole quota: omitted fields take the platform defaults."""
    tenant = await TenantService(session, platform.settings).replace_quota(tenant_id, body)
    await session.commit()
    await platform.tenant_changed(tenant_id)
    return tenant_out(tenant).quota


@router.patch("/tenants/{tenant_id}/quota", operation_id="update_quota", response_model=Quota, responses=error_responses(*_AUTH, *_BODY, 404))
async def update_quota(tenant_id: TenantId, body: QuotaUpdate, session: SessionDep, platform: PlatformDep) -> Quota:
    """Change only the fields given; the others keep their values."""
    tenant = await TenantService(session, platform.settings).update_quota(tenant_id, body)
    await session.commit()
    await platform.tenant_changed(tenant_id)
    return tenant_out(tenant).quota


@router.post(
    "/tenants/{tenant_id}/api-keys",
    status_code=201,
    operation_id="create_api_key",
    response_model=ApiKeyCreated,
    responses=error_responses(*_AUTH, 404, 409, 422, s409="the tenant is disabled"),
)
async def create_api_key(tenant_id: TenantId, session: SessionDep, platform: PlatformDep) -> ApiKeyCreated:
    await TenantService(session, platform.settings).get(tenant_id)
    row, key = await ApiKeyService(session).create(tenant_id)
    await session.commit()
    return ApiKeyCreated(id=row.id, key=key, prefix=row.prefix, created_at=row.created_at)


@router.get("/tenants/{tenant_id}/api-keys", operation_id="list_api_keys", response_model=list[ApiKeyOut], responses=error_responses(*_AUTH, 404, 422))
async def list_api_keys(tenant_id: TenantId, session: SessionDep, platform: PlatformDep) -> list[ApiKeyOut]:
    await TenantService(session, platform.settings).get(tenant_id)
    return [
        ApiKeyOut(id=k.id, prefix=k.prefix, created_at=k.created_at, last_used_at=k.last_used_at, revoked_at=k.revoked_at)
        for k in await ApiKeyService(session).list(tenant_id)
    ]


@router.delete("/tenants/{tenant_id}/api-keys/{key_id}", status_code=204, operation_id="revoke_api_key", responses=error_responses(*_AUTH, 404, 422))
async def revoke_api_key(tenant_id: TenantId, key_id: KeyId, session: SessionDep, platform: PlatformDep) -> Response:
    await ApiKeyService(session).revoke(tenant_id, key_id)
    await session.commit()
    platform.auth_cache.clear()
    await platform.changed(ChangeKind.KEYS, tenant_id)
    return Response(status_code=204)


@router.get("/workers", operation_id="list_workers", response_model=list[WorkerOut], responses=error_responses(*_AUTH))
async def list_workers(platform: PlatformDep) -> list[WorkerOut]:
    return [
        WorkerOut(
            id=w.id,
            pid=w.pid,
            state=w.state,
            backend=w.backend,
            device=w.device,
            tenant_id=w.tenant_id,
            tenant=w.tenant,
            gpu_bytes_in_use=w.gpu_bytes_in_use,
            gpu_bytes_cap=w.gpu_bytes_cap,
            invocations=w.invocations,
            started_at=datetime.fromisoformat(w.started_at),
        )
        for w in await platform.node.workers()
    ]
