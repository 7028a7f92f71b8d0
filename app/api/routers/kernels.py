from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from app.api.body import read_limited, require_content_type
from app.api.deps import PlatformDep, SessionDep, TenantDep
from app.api.errors import ApiError, error_responses
from app.api.routers.functions import NameParam
from app.api.schemas import KernelOut
from app.contract.messages import ChangeKind
from app.db.models import Kernel
from app.services.kernels import KernelService

router = APIRouter(prefix="/v1/kernels", tags=["kernels"])
MAX_SOURCE_BYTES = 1024 * 1024


def kernel_out(k: Kernel, with_source: bool = False) -> KernelOut:
    return KernelOut(
        name=k.name,
        sha256=k.sha256,
        size=len(k.source.encode()),
        created_at=k.created_at,
        updated_at=k.updated_at,
        source=k.source if with_source else None,
    )


@router.put(
    "/{name}",
    operation_id="put_kernel",
    response_model=KernelOut,
    responses={
        201: {"description": "created", "model": KernelOut},
        **error_responses(
            400, 401, 403, 409, 413, 415, 422, 429,
            s403="wrong kind of credentials, a disabled tenant, or the kernel module quota reached",
            s429="this tenant's request bodies in flight in this front reached TENSORWASM_MAX_TENANT_BODY_BYTES; see Retry-After",
            s409="`std` is the platform's library",
            s422="invalid name, not UTF-8 text, or compile_failed",
        ),
    },
    openapi_extra={"requestBody": {"required": True, "content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def put_kernel(name: NameParam, request: Request, tenant: TenantDep, session: SessionDep, platform: PlatformDep) -> JSONResponse:
    require_content_type(request, "text/plain", "text/x-cuda", "application/octet-stream")
    with platform.bodies.hold(tenant.id) as hold:
        raw = await read_limited(request, MAX_SOURCE_BYTES, "the kernel source", hold)
        if b"\x00" in raw:  # neither CUDA source nor a database text column holds NUL
            raise ApiError(422, "invalid_kernel", "kernel source must be UTF-8 text without NUL bytes")
        arch = next((w.compute_capability for w in await platform.node.workers() if w.backend == "cuda"), None)
        kernel, created = await KernelService(session, tenant).put(name, raw, arch or None, platform.compiler)
    await session.commit()
    platform.function_cache.drop_kernels(tenant.id)
    await platform.changed(ChangeKind.KERNELS, tenant.id)
    return JSONResponse(status_code=201 if created else 200, content=kernel_out(kernel).model_dump(mode="json"))


@router.get("", operation_id="list_kernels", response_model=list[KernelOut], responses=error_responses(401, 403))
async def list_kernels(tenant: TenantDep, session: SessionDep) -> list[KernelOut]:
    return [kernel_out(k) for k in await KernelService(session, tenant).list()]


@router.get("/{name}", operation_id="get_kernel", response_model=KernelOut, responses=error_responses(401, 403, 404, 422))
async def get_kernel(name: NameParam, tenant: TenantDep, session: SessionDep) -> KernelOut:
    return kernel_out(await KernelService(session, tenant).get(name), with_source=True)


@router.delete("/{name}", status_code=204, operation_id="delete_kernel", responses=error_responses(401, 403, 404, 422))
async def delete_kernel(name: NameParam, tenant: TenantDep, session: SessionDep, platform: PlatformDep) -> Response:
    await KernelService(session, tenant).delete(name)
    await session.commit()
    platform.function_cache.drop_kernels(tenant.id)
    await platform.changed(ChangeKind.KERNELS, tenant.id)
    return Response(status_code=204)
