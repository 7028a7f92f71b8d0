from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import JSONResponse

from app.api.body import LimitedBodyRoute, read_limited, require_content_type
from app.api.deps import PlatformDep, SessionDep, TenantDep
from app.api.errors import ApiError, error_responses
from app.api.media import MAX_MEDIA_TYPE_LENGTH, MEDIA_TYPE_PATTERN, is_media_type
from app.api.schemas import NAME_PATTERN, FunctionOut, FunctionVersionOut
from app.contract.messages import ChangeKind
from app.db.models import Function
from app.db.repositories.functions import FunctionRepository
from app.services.functions import FunctionService, FunctionSettings
from app.services.principal import QUOTA_BOUNDS

router = APIRouter(prefix="/v1/functions", tags=["functions"], route_class=LimitedBodyRoute)

NameParam = Annotated[str, Path(pattern=NAME_PATTERN, description="letters, digits, - and _, at most 63")]
# a shell name, matched whole (fullmatch: no trailing newline slips through)
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
# values are text without control characters (a NUL would make every instantiation fail)
_ENV_VALUE = re.compile(r"[^\x00-\x1f\x7f]{0,4096}")
MAX_ENV_ENTRIES = 64
_RESERVED_ENV = {"TW_FUNCTION", "TW_INVOCATION_ID", "TW_TENANT", "QUERY_STRING", "CONTENT_TYPE"}


async def function_out(repo: FunctionRepository, fn: Function, with_versions: bool = False) -> FunctionOut:
    meta = await repo.version_meta(fn, fn.current_version)
    assert meta is not None
    versions = None
    if with_versions:
        versions = [FunctionVersionOut(version=v, sha256=s, size=z, created_at=c) for v, s, z, c in await repo.versions(fn)]  # type: ignore[arg-type]
    return FunctionOut(
        name=fn.name,
        version=fn.current_version,
        sha256=meta[0],
        size=meta[1],
        env=fn.env or {},
        content_type=fn.content_type,
        timeout_ms=fn.timeout_ms,
        created_at=fn.created_at,
        updated_at=fn.updated_at,
        versions=versions,
    )


def _parse_env(items: list[str] | None) -> dict[str, str] | None:
    if items is None:
        return None
    if len(items) > MAX_ENV_ENTRIES:
        raise ApiError(422, "validation_error", f"at most {MAX_ENV_ENTRIES} env entries, got {len(items)}")
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not _ENV_KEY.fullmatch(key):
            raise ApiError(
                422, "validation_error",
                f"env entries are KEY=VALUE with KEY matching [A-Za-z_][A-Za-z0-9_]* (at most 128), got {item[:80]!r}",
            )
        if not _ENV_VALUE.fullmatch(value):
            raise ApiError(
                422, "validation_error",
                f"the value of env variable {key} must be at most 4096 characters without control characters",
            )
        if key in _RESERVED_ENV:
            raise ApiError(422, "validation_error", f"env variable {key} is set by the platform")
        env[key] = value
    return env


@router.put(
    "/{name}",
    operation_id="deploy_function",
    response_model=FunctionOut,
    responses={
        200: {"description": "a new version (or unchanged bytes)"},
        201: {"description": "created", "model": FunctionOut},
        **error_responses(
            400, 401, 403, 413, 415, 422, 429,
            s403="wrong kind of credentials, a disabled tenant, or the function quota reached",
            s429="this tenant's request bodies in flight in this front reached TENSORWASM_MAX_TENANT_BODY_BYTES; see Retry-After",
            s422="invalid module, query or name",
        ),
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/wasm": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
async def deploy_function(
    name: NameParam,
    request: Request,
    tenant: TenantDep,
    session: SessionDep,
    platform: PlatformDep,
    env: Annotated[list[str] | None, Query(description="KEY=VALUE, repeatable; replaces the function's variables")] = None,
    content_type: Annotated[
        str | None,
        Query(
            max_length=MAX_MEDIA_TYPE_LENGTH,
            description="Content-Type of invoke responses: a media type such as `text/plain; charset=utf-8`",
            json_schema_extra={"pattern": MEDIA_TYPE_PATTERN},
        ),
    ] = None,
    timeout_ms: Annotated[
        int | None, Query(ge=1, le=QUOTA_BOUNDS["timeout_ms"], description="per-call limit, at most the tenant quota")
    ] = None,
) -> JSONResponse:
    require_content_type(request, "application/wasm")
    if content_type is not None and not is_media_type(content_type):
        raise ApiError(
            422, "validation_error",
            "content_type must be a media type such as `text/plain; charset=utf-8` (printable ASCII, no control characters)",
        )
    settings = FunctionSettings(env=_parse_env(env), content_type=content_type, timeout_ms=timeout_ms)
    with platform.bodies.hold(tenant.id) as hold:
        wasm = await read_limited(request, tenant.quota.max_module_bytes, "the module", hold)
        service = FunctionService(session, tenant)
        result = await service.deploy(name, wasm, settings, platform.compiler)
    out = await function_out(service.repo, result.function)
    await session.commit()
    platform.function_cache.remember(tenant.id, platform.function_cache.meta_for(result.function, result.sha256))
    await platform.function_cache.kernels(tenant.id)  # warm too: a first call often follows a deploy
    await platform.changed(ChangeKind.FUNCTION, tenant.id, name)
    return JSONResponse(status_code=201 if result.created else 200, content=out.model_dump(mode="json"))


@router.get("", operation_id="list_functions", response_model=list[FunctionOut], responses=error_responses(401, 403))
async def list_functions(tenant: TenantDep, session: SessionDep) -> list[FunctionOut]:
    repo = FunctionRepository(session, tenant.id)
    return [await function_out(repo, fn) for fn in await repo.list()]


@router.get("/{name}", operation_id="get_function", response_model=FunctionOut, responses=error_responses(401, 403, 404, 422))
async def get_function(name: NameParam, tenant: TenantDep, session: SessionDep) -> FunctionOut:
    service = FunctionService(session, tenant)
    return await function_out(service.repo, await service.get(name), with_versions=True)


@router.delete("/{name}", status_code=204, operation_id="delete_function", responses=error_responses(401, 403, 404, 422))
async def delete_function(name: NameParam, tenant: TenantDep, session: SessionDep, platform: PlatformDep) -> Response:
    await FunctionService(session, tenant).delete(name)
    await session.commit()
    platform.function_cache.drop(tenant.id, name)
    await platform.changed(ChangeKind.FUNCTION, tenant.id, name)
    return Response(status_code=204)
