from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import JSONResponse

from app.contract.messages import ChangeKind
from app.api.body import read_limited, require_content_type
from app.api.deps import PlatformDep, SessionDep, TenantDep
from app.api.errors import ApiError
from app.api.schemas import NAME_PATTERN, FunctionOut, FunctionVersionOut
from app.db.models import Function
from app.db.repositories.functions import FunctionRepository
from app.services.functions import FunctionService, FunctionSettings

router = APIRouter(prefix="/v1/functions", tags=["functions"])

NameParam = Annotated[str, Path(pattern=NAME_PATTERN, description="letters, digits, - and _, at most 63")]
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
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
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not _ENV_KEY.match(key):
            raise ApiError(422, "validation_error", f"env entries are KEY=VALUE with KEY a shell name, got {item!r}")
        if key in _RESERVED_ENV:
            raise ApiError(422, "validation_error", f"env variable {key} is set by the platform")
        env[key] = value
    return env


@router.put(
    "/{name}",
    operation_id="deploy_function",
    response_model=FunctionOut,
    responses={200: {"description": "a new version (or unchanged bytes)"}, 201: {"description": "created"}},
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
    content_type: Annotated[str | None, Query(max_length=255, description="Content-Type of invoke responses")] = None,
    timeout_ms: Annotated[int | None, Query(ge=1, description="per-call limit, at most the tenant quota")] = None,
) -> JSONResponse:
    require_content_type(request, "application/wasm")
    settings = FunctionSettings(env=_parse_env(env), content_type=content_type, timeout_ms=timeout_ms)
    wasm = await read_limited(request, tenant.quota.max_module_bytes, "the module")
    service = FunctionService(session, tenant)
    result = await service.deploy(name, wasm, settings, platform.compiler)
    out = await function_out(service.repo, result.function)
    await session.commit()
    platform.function_cache.remember(tenant.id, platform.function_cache.meta_for(result.function, result.sha256))
    await platform.function_cache.kernels(tenant.id)  # warm too: a first call often follows a deploy
    platform.changed(ChangeKind.FUNCTION, tenant.id, name)
    return JSONResponse(status_code=201 if result.created else 200, content=out.model_dump(mode="json"))


@router.get("", operation_id="list_functions", response_model=list[FunctionOut])
async def list_functions(tenant: TenantDep, session: SessionDep) -> list[FunctionOut]:
    repo = FunctionRepository(session, tenant.id)
    return [await function_out(repo, fn) for fn in await repo.list()]


@router.get("/{name}", operation_id="get_function", response_model=FunctionOut)
async def get_function(name: NameParam, tenant: TenantDep, session: SessionDep) -> FunctionOut:
    service = FunctionService(session, tenant)
    return await function_out(service.repo, await service.get(name), with_versions=True)


@router.delete("/{name}", status_code=204, operation_id="delete_function")
async def delete_function(name: NameParam, tenant: TenantDep, session: SessionDep, platform: PlatformDep) -> Response:
    await FunctionService(session, tenant).delete(name)
    await session.commit()
    platform.function_cache.drop(tenant.id, name)
    platform.changed(ChangeKind.FUNCTION, tenant.id, name)
    return Response(status_code=204)
