"""Tenants' secrets: PUT a value, list names and times, delete. A value is never answered."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response
from fastapi.responses import JSONResponse

from app.api.body import read_limited
from app.api.deps import PlatformDep, SessionDep, TenantDep
from app.api.errors import error_responses
from app.api.schemas import SECRET_NAME_PATTERN, SecretOut
from app.contract.messages import ChangeKind, Principal
from app.db.models import Secret
from app.db.repositories.secrets import SecretRepository
from app.services.secrets import MAX_SECRET_BYTES, SecretService

router = APIRouter(prefix="/v1/secrets", tags=["secrets"])

SecretName = Annotated[
    str, Path(pattern=SECRET_NAME_PATTERN, description="the variable the guest sees: [A-Za-z_][A-Za-z0-9_]*, at most 128")
]


def secret_out(s: Secret) -> SecretOut:
    return SecretOut(name=s.name, size=s.size, created_at=s.created_at, updated_at=s.updated_at)


async def _functions_changed(platform: PlatformDep, tenant: Principal, names: list[str]) -> None:
    """The functions whose versions get a changed secret read it again on every front."""
    for name in names:
        platform.function_cache.forget(tenant.id, name)
        await platform.changed(ChangeKind.FUNCTION, tenant.id, name)


@router.put(
    "/{name}",
    operation_id="put_secret",
    response_model=SecretOut,
    responses={
        200: {"description": "replaced: functions that get it see the new value from their next call"},
        201: {"description": "created", "model": SecretOut},
        **error_responses(
            400, 401, 403, 409, 413, 422, 429,
            s409="the tenant's max_secrets or max_secret_bytes quota would be passed (quota_exceeded)",
            s413=f"the value is larger than {MAX_SECRET_BYTES} bytes",
            s422="an invalid name, or a value that is not UTF-8 text without NUL (it becomes an environment variable)",
            s429="this tenant's request bodies in flight in this front reached TENSORWASM_MAX_TENANT_BODY_BYTES; see Retry-After",
        ),
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                "text/plain": {"schema": {"type": "string"}},
            },
        }
    },
)
async def put_secret(name: SecretName, request: Request, tenant: TenantDep, session: SessionDep, platform: PlatformDep) -> JSONResponse:
    """The body is the value, as it is (UTF-8 text, at most 64 KiB), sealed with the node key
    before it is stored. Functions name it at deploy (`secret=NAME`) and get it as the variable
    NAME; the value is never shown again."""
    with platform.bodies.hold(tenant.id) as hold:
        value = await read_limited(request, MAX_SECRET_BYTES, "the secret's value", hold)
        secret, created = await SecretService(session, tenant, platform.function_cache.keys_for(platform.settings)).put(name, value)
    out = secret_out(secret)
    users = [] if created else await SecretRepository(session, tenant.id).referencing(name)
    await session.commit()
    await _functions_changed(platform, tenant, users)
    return JSONResponse(status_code=201 if created else 200, content=out.model_dump(mode="json"))


@router.get("", operation_id="list_secrets", response_model=list[SecretOut], responses=error_responses(401, 403))
async def list_secrets(tenant: TenantDep, session: SessionDep) -> list[SecretOut]:
    """Names, sizes and times; never values."""
    return [secret_out(s) for s in await SecretRepository(session, tenant.id).list()]


@router.delete(
    "/{name}",
    status_code=204,
    operation_id="delete_secret",
    responses=error_responses(
        401, 403, 404, 409, 422,
        s404="no such secret",
        s409="the active version of a function gets it (secret_in_use, the functions named): deploy them without it first",
    ),
)
async def delete_secret(name: SecretName, tenant: TenantDep, session: SessionDep, platform: PlatformDep) -> Response:
    """Refused while the active version of a function gets it. A version that is not active may
    still name it: a rollback to it is refused (422 secret_not_found), a call pinned to it fails
    (409 secret_not_found)."""
    await SecretService(session, tenant, platform.function_cache.keys_for(platform.settings)).delete(name)
    users = await SecretRepository(session, tenant.id).referencing(name)
    await session.commit()
    await _functions_changed(platform, tenant, users)
    return Response(status_code=204)
