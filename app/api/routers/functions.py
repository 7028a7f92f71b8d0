from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import JSONResponse

from app.api.body import LimitedBodyRoute, read_limited, require_content_type
from app.api.deps import PlatformDep, SessionDep, TenantDep
from app.api.errors import ApiError, error_responses
from app.api.media import MAX_MEDIA_TYPE_LENGTH, MEDIA_TYPE_PATTERN, is_media_type
from app.api.schemas import NAME_PATTERN, FilesOut, FunctionOut, FunctionVersionOut, RollbackIn
from app.contract.messages import ChangeKind, Principal
from app.db.models import Function, FunctionVersion
from app.db.repositories.functions import FunctionRepository
from app.queue.states import MAX_ATTEMPTS
from app.services.body_budget import BodyHold
from app.services.functions import (
    FilesResult,
    FunctionService,
    FunctionSettings,
    drop_unused_artifacts,
    drop_unused_bundles,
)
from app.services.guest_inputs import check_args, parse_env
from app.services.principal import QUOTA_BOUNDS
from app.services.secrets import check_names

router = APIRouter(prefix="/v1/functions", tags=["functions"], route_class=LimitedBodyRoute)

NameParam = Annotated[str, Path(pattern=NAME_PATTERN, description="letters, digits, - and _, at most 63")]


async def function_out(repo: FunctionRepository, fn: Function, with_versions: bool = False) -> FunctionOut:
    meta = await repo.version_meta(fn, fn.current_version)
    assert meta is not None
    files = await repo.files(fn) if fn.files_sha256 else None
    versions = None
    if with_versions:
        versions = [version_out(fn, v) for v in await repo.versions_settings(fn)]
    return FunctionOut(
        name=fn.name,
        version=fn.current_version,
        sha256=meta[0],
        size=meta[1],
        env=fn.env or {},
        args=list(fn.args or []),
        cgi=fn.cgi,
        scratch=fn.scratch,
        files=FilesOut.model_validate(files, from_attributes=True) if files is not None else None,
        content_type=fn.content_type,
        timeout_ms=fn.timeout_ms,
        max_attempts=fn.max_attempts,
        secrets=list(fn.secrets or []),
        created_at=fn.created_at,
        updated_at=fn.updated_at,
        versions=versions,
    )


def version_out(fn: Function, v: FunctionVersion) -> FunctionVersionOut:
    return FunctionVersionOut(
        version=v.version, active=v.version == fn.current_version, sha256=v.sha256, size=v.size, env=v.env or {},
        args=list(v.args or []), cgi=v.cgi, scratch=v.scratch, content_type=v.content_type, timeout_ms=v.timeout_ms,
        secrets=list(v.secrets or []), created_at=v.created_at,
    )


async def _read_module(request: Request, limit: int, hold: BodyHold) -> bytes:
    """The module's bytes; past the tenant's max_module_bytes a 413 that names the quota."""
    try:
        return await read_limited(request, limit, "the module", hold)
    except ApiError as exc:
        if exc.status != 413:
            raise
        size = request.headers.get("content-length")
        sent = f" ({size} bytes)" if size and size.isdigit() else ""
        raise ApiError(
            413, exc.code,
            f"the module{sent} is larger than this tenant's max_module_bytes quota of {limit} bytes ({limit / 2**20:.1f} MiB); "
            "make it smaller (e.g. build with -O2 -s, or run wasm-opt) or ask an operator to raise the quota",
        ) from None


@router.put(
    "/{name}",
    operation_id="deploy_function",
    response_model=FunctionOut,
    responses={
        200: {"description": "a new version (or, module and settings unchanged, the active one)"},
        201: {"description": "created", "model": FunctionOut},
        **error_responses(
            400, 401, 403, 409, 413, 415, 422, 429,
            s403="wrong kind of credentials, or a disabled tenant",
            s409="the tenant has max_functions functions (quota_exceeded); delete one first",
            s429="the new version would take the tenant past max_stored_bytes (storage_quota_exceeded), or this "
            "tenant's request bodies in flight in this front reached TENSORWASM_MAX_TENANT_BODY_BYTES (see Retry-After)",
            s413="the module is larger than the tenant's max_module_bytes quota (the message names it)",
            s422="invalid module, query or name; a secret the tenant does not have (secret_not_found, named)",
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
    env: Annotated[
        list[str] | None,
        Query(description="KEY=VALUE, repeatable; replaces the function's variables (a value: any characters but NUL)"),
    ] = None,
    arg: Annotated[
        list[str] | None,
        Query(description="repeatable: the default argv after the function's name; replaces the function's arguments"),
    ] = None,
    cgi: Annotated[
        bool | None,
        Query(description="add the request variables (QUERY_STRING, CONTENT_TYPE, TW_FUNCTION, TW_INVOCATION_ID, TW_TENANT) "
              "to the environment; false: the guest sees exactly the variables it was deployed with"),
    ] = None,
    scratch: Annotated[
        bool | None,
        Query(description="each call gets a writable in-memory copy of the function's files (capped by the scratch_bytes "
              "quota, emptied after the call) instead of the read-only bundle"),
    ] = None,
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
    secret: Annotated[
        list[str] | None,
        Query(description="repeatable: a secret of the tenant (PUT /v1/secrets/{name}) the guest gets as the variable of its "
              "name; replaces the function's secrets (one empty `secret=`: none)"),
    ] = None,
    max_attempts: Annotated[
        int | None,
        Query(ge=1, le=MAX_ATTEMPTS, description="runs of one async invocation at most (default 3; 1: never run again): "
              "one whose node is lost mid-run is queued again until then, so the guest must tolerate a repeated run"),
    ] = None,
) -> JSONResponse:
    require_content_type(request, "application/wasm")
    if content_type is not None and not is_media_type(content_type):
        raise ApiError(
            422, "validation_error",
            "content_type must be a media type such as `text/plain; charset=utf-8` (printable ASCII, no control characters)",
        )
    settings = FunctionSettings(
        env=parse_env(env) if env is not None else None,
        args=check_args(arg, "arg") if arg is not None else None,
        cgi=cgi, scratch=scratch, content_type=content_type, timeout_ms=timeout_ms,
        max_attempts=max_attempts,
        secrets=check_names(n for n in secret if n) if secret is not None else None,
    )
    with platform.bodies.hold(tenant.id) as hold:
        wasm = await _read_module(request, tenant.quota.max_module_bytes, hold)
        service = FunctionService(session, tenant)
        result = await service.deploy(name, wasm, settings, platform.compiler, platform.settings.kept_versions)
    out = await function_out(service.repo, result.function)
    await session.commit()
    await drop_unused_artifacts(session, platform.compiler.cache, result.pruned)
    await _serve_active(platform, tenant, name)
    return JSONResponse(status_code=201 if result.created else 200, content=out.model_dump(mode="json"))


async def _serve_active(platform: PlatformDep, tenant: Principal, name: str) -> None:
    """After a commit that changed the active version: this front serves it from the next call
    (read again, its secrets opened), and every other front drops what it had."""
    # pinned versions and a note that the name was missing go too: the name may be new, or reused
    platform.function_cache.forget(tenant.id, name)
    platform.function_cache.remember(tenant.id, await platform.function_cache.function(tenant.id, name, fresh=True))
    await platform.function_cache.kernels(tenant.id)  # warm too: a first call often follows a deploy
    await platform.changed(ChangeKind.FUNCTION, tenant.id, name)


@router.get(
    "/{name}/versions",
    operation_id="list_function_versions",
    response_model=list[FunctionVersionOut],
    responses=error_responses(401, 403, 404, 422, s404="no such function"),
)
async def list_function_versions(name: NameParam, tenant: TenantDep, session: SessionDep) -> list[FunctionVersionOut]:
    """The versions the function keeps, oldest first; `active` marks the one calls run."""
    fn, versions = await FunctionService(session, tenant).versions(name)
    return [version_out(fn, v) for v in versions]


@router.post(
    "/{name}/rollback",
    operation_id="rollback_function",
    response_model=FunctionOut,
    responses=error_responses(
        400, 401, 403, 404, 413, 422,
        s404="no such function (not_found), or it no longer keeps that version (version_not_found: versions past the "
        "kept count are deleted, the active one never)",
        s422="a bad body; or the version gets a secret deleted since (secret_not_found) or a timeout past the quota",
    ),
)
async def rollback_function(
    name: NameParam, body: RollbackIn, tenant: TenantDep, session: SessionDep, platform: PlatformDep
) -> FunctionOut:
    """Make a kept version the active one: calls that pin no version run it (its module and
    settings) from the next call on, on every front. The function's files are not versioned."""
    fn, _ = await FunctionService(session, tenant).rollback(name, body.version)
    out = await function_out(FunctionRepository(session, tenant.id), fn)
    await session.commit()
    await _serve_active(platform, tenant, name)
    return out


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
    shas, files = await FunctionService(session, tenant).delete(name)
    await session.commit()
    await drop_unused_artifacts(session, platform.compiler.cache, shas)
    await drop_unused_bundles(session, platform.function_cache.bundles, {files} if files else set())
    platform.function_cache.drop(tenant.id, name)
    await platform.changed(ChangeKind.FUNCTION, tenant.id, name)
    return Response(status_code=204)


async def _files_changed(session: SessionDep, platform: PlatformDep, tenant: TenantDep, result: FilesResult) -> FunctionOut:
    """After a change of files: commit, drop this node's copy of files no function uses now,
    and serve the new files from the next call on every front."""
    out = await function_out(FunctionRepository(session, tenant.id), result.function)
    await session.commit()
    if result.replaced:
        await drop_unused_bundles(session, platform.function_cache.bundles, {result.replaced})
    meta = await platform.function_cache.function(tenant.id, result.function.name, fresh=True)  # unpacks them here
    platform.function_cache.remember(tenant.id, meta)
    await platform.changed(ChangeKind.FUNCTION, tenant.id, result.function.name)
    return out


@router.put(
    "/{name}/files",
    operation_id="put_function_files",
    response_model=FunctionOut,
    responses=error_responses(
        400, 401, 403, 404, 413, 415, 422, 429,
        s403="wrong kind of credentials, or a disabled tenant",
        s404="no such function (deploy its module first)",
        s413="the archive is larger than max_files_bytes allows (with its tar headers)",
        s422="not a tar archive, or a member that cannot be a function's file (invalid_archive: an absolute path, `..`, "
        "a hard link, a device, a link pointing outside), files past max_files_bytes (files_quota_exceeded) or, with "
        "scratch on, a copy past scratch_bytes (scratch_quota_exceeded)",
        s429="the archive would take the tenant past max_stored_bytes (storage_quota_exceeded), or its request bodies in "
        "flight in this front reached TENSORWASM_MAX_TENANT_BODY_BYTES (see Retry-After)",
    ),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
async def put_function_files(
    name: NameParam, request: Request, tenant: TenantDep, session: SessionDep, platform: PlatformDep
) -> FunctionOut:
    """The function's guest sees these files at `/`: read-only, or with scratch on, a writable copy
    of its own for each call. Regular files, directories and symbolic links that stay inside."""
    require_content_type(request, "application/x-tar")
    entries = platform.settings.max_files_entries
    # the files' bytes, and a tar header and padding for each entry, and the archive's end
    limit = tenant.quota.max_files_bytes + 1024 * entries + 10240
    with platform.bodies.hold(tenant.id) as hold:
        archive = await read_limited(request, limit, "the archive", hold)
        result = await FunctionService(session, tenant).put_files(name, archive, entries)
    return await _files_changed(session, platform, tenant, result)


@router.delete(
    "/{name}/files", operation_id="delete_function_files", response_model=FunctionOut,
    responses=error_responses(401, 403, 404, 422, s404="no such function, or it has no files"),
)
async def delete_function_files(name: NameParam, tenant: TenantDep, session: SessionDep, platform: PlatformDep) -> FunctionOut:
    """The function's guest has no files from the next call on."""
    return await _files_changed(session, platform, tenant, await FunctionService(session, tenant).delete_files(name))
