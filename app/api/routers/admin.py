from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path, Response

from app.api.body import LimitedBodyRoute
from app.api.deps import AdminDep, PlatformDep, SessionDep
from app.api.errors import error_responses
from app.api.schemas import ID_PATTERN, ApiKeyCreated, ApiKeyOut, NodeOut, Quota, QuotaUpdate, TenantCreate, TenantOut, TenantUpdate, WorkerOut
from app.contract.messages import ChangeKind
from app.db.models import Tenant
from app.services.api_keys import ApiKeyService
from app.services.functions import drop_unused_artifacts
from app.services.nodes import list_nodes
from app.services.principal import public_quota, quota_of
from app.services.tenants import TenantService

router = APIRouter(prefix="/v1/admin", tags=["admin"], dependencies=[AdminDep], route_class=LimitedBodyRoute)

# Every /tenants/{tenant_id} route takes a tenant's id or its name: an id is looked up first.
TenantId = Annotated[
    str, Path(pattern=ID_PATTERN, description="the tenant's id or its name (an id is looked up first, then a name)")
]
_BY_REF = "The tenant is named by its id or its name."
KeyId = Annotated[str, Path(pattern=ID_PATTERN, description="the key's id")]
# every admin route: no or a wrong token (401), a tenant key (403)
_AUTH = (401, 403)
_BODY = (400, 413, 422)  # JSON bodies: bad Content-Length, over TENSORWASM_MAX_JSON_BYTES, invalid


def tenant_out(t: Tenant) -> TenantOut:
    return TenantOut(
        id=t.id,
        name=t.name,
        disabled=t.disabled,
        quota=Quota.model_validate(public_quota(quota_of(t))),
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


@router.get(
    "/tenants/{tenant_id}", operation_id="get_tenant", response_model=TenantOut, responses=error_responses(*_AUTH, 404, 422),
    description=_BY_REF,
)
async def get_tenant(tenant_id: TenantId, session: SessionDep, platform: PlatformDep) -> TenantOut:
    return tenant_out(await TenantService(session, platform.settings).get(tenant_id))


@router.patch(
    "/tenants/{tenant_id}", operation_id="update_tenant", response_model=TenantOut, responses=error_responses(*_AUTH, *_BODY, 404, 409),
    description=f"Rename, disable or enable a tenant. {_BY_REF}",
)
async def update_tenant(tenant_id: TenantId, body: TenantUpdate, session: SessionDep, platform: PlatformDep) -> TenantOut:
    tenant = await TenantService(session, platform.settings).update(tenant_id, body, platform.clock())
    await session.commit()
    await platform.tenant_changed(tenant.id)
    return tenant_out(tenant)


@router.delete(
    "/tenants/{tenant_id}", status_code=204, operation_id="delete_tenant", responses=error_responses(*_AUTH, 404, 422),
    description=f"Delete a tenant with its functions, kernels, keys and records. {_BY_REF}",
)
async def delete_tenant(tenant_id: TenantId, session: SessionDep, platform: PlatformDep) -> Response:
    await platform.recorder.flush()  # its pending records reference the tenant
    tenants = TenantService(session, platform.settings)
    tenant = await tenants.get(tenant_id)
    found = tenant.id
    shas = await tenants.delete(tenant)
    await session.commit()
    await drop_unused_artifacts(session, platform.compiler.cache, shas)
    await platform.tenant_changed(found)
    return Response(status_code=204)


@router.get(
    "/tenants/{tenant_id}/quota", operation_id="get_quota", response_model=Quota, responses=error_responses(*_AUTH, 404, 422),
    description=_BY_REF,
)
async def get_quota(tenant_id: TenantId, session: SessionDep, platform: PlatformDep) -> Quota:
    return tenant_out(await TenantService(session, platform.settings).get(tenant_id)).quota


@router.put(
    "/tenants/{tenant_id}/quota", operation_id="replace_quota", response_model=Quota, responses=error_responses(*_AUTH, *_BODY, 404),
    description=f"Replace the whole quota: omitted fields take the platform defaults. {_BY_REF}",
)
async def replace_quota(tenant_id: TenantId, body: QuotaUpdate, session: SessionDep, platform: PlatformDep) -> Quota:
    tenant = await TenantService(session, platform.settings).replace_quota(tenant_id, body)
    await session.commit()
    await platform.tenant_changed(tenant.id)
    return tenant_out(tenant).quota


@router.patch(
    "/tenants/{tenant_id}/quota", operation_id="update_quota", response_model=Quota, responses=error_responses(*_AUTH, *_BODY, 404),
    description=f"Change only the fields given; the others keep their values. {_BY_REF}",
)
async def update_quota(tenant_id: TenantId, body: QuotaUpdate, session: SessionDep, platform: PlatformDep) -> Quota:
    tenant = await TenantService(session, platform.settings).update_quota(tenant_id, body)
    await session.commit()
    await platform.tenant_changed(tenant.id)
    return tenant_out(tenant).quota


@router.post(
    "/tenants/{tenant_id}/api-keys",
    status_code=201,
    operation_id="create_api_key",
    response_model=ApiKeyCreated,
    responses=error_responses(*_AUTH, 404, 409, 422, s409="the tenant is disabled"),
    description=f"Mint an API key; the key is in this answer only. {_BY_REF}",
)
async def create_api_key(tenant_id: TenantId, session: SessionDep, platform: PlatformDep) -> ApiKeyCreated:
    tenant = await TenantService(session, platform.settings).get(tenant_id)
    row, key = await ApiKeyService(session).create(tenant.id)
    await session.commit()
    return ApiKeyCreated(id=row.id, key=key, prefix=row.prefix, created_at=row.created_at)


@router.get(
    "/tenants/{tenant_id}/api-keys", operation_id="list_api_keys", response_model=list[ApiKeyOut],
    responses=error_responses(*_AUTH, 404, 422), description=f"A tenant's API keys (prefixes only). {_BY_REF}",
)
async def list_api_keys(tenant_id: TenantId, session: SessionDep, platform: PlatformDep) -> list[ApiKeyOut]:
    tenant = await TenantService(session, platform.settings).get(tenant_id)
    return [
        ApiKeyOut(id=k.id, prefix=k.prefix, created_at=k.created_at, last_used_at=k.last_used_at, revoked_at=k.revoked_at)
        for k in await ApiKeyService(session).list(tenant.id)
    ]


@router.delete(
    "/tenants/{tenant_id}/api-keys/{key_id}", status_code=204, operation_id="revoke_api_key", responses=error_responses(*_AUTH, 404, 422),
    description=f"Revoke one API key of a tenant. {_BY_REF}",
)
async def revoke_api_key(tenant_id: TenantId, key_id: KeyId, session: SessionDep, platform: PlatformDep) -> Response:
    tenant = await TenantService(session, platform.settings).get(tenant_id)
    await ApiKeyService(session).revoke(tenant.id, key_id)
    await session.commit()
    platform.auth_cache.clear()
    await platform.changed(ChangeKind.KEYS, tenant.id)
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


@router.get(
    "/nodes", operation_id="list_nodes", response_model=list[NodeOut], responses=error_responses(*_AUTH),
    description="The cluster's nodes as the nodes table holds them (every node sharing this database), alive or not, "
    "as the answering node's clock sees them. A node stopped cleanly leaves the table; one dead for a day is pruned.",
)
async def get_nodes(session: SessionDep, platform: PlatformDep) -> list[NodeOut]:
    return [NodeOut.model_validate(n, from_attributes=True) for n in await list_nodes(session, platform.settings, platform.clock())]
