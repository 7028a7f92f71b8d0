"""POST /v1/functions/{name}/invocations: queue an async invocation (durable before the 202)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import JSONResponse

from app.api.body import read_limited
from app.api.call_args import call_args, call_version
from app.api.deps import PlatformDep, TenantDep
from app.api.errors import error_responses
from app.api.routers.functions import NameParam
from app.api.routers.invocations import invocation_out
from app.api.schemas import InvocationOut
from app.services.callbacks import check_url

router = APIRouter(prefix="/v1/functions", tags=["invocations"])


@router.post(
    "/{name}/invocations",
    operation_id="submit_invocation",
    status_code=202,
    response_model=InvocationOut,
    responses={
        202: {"description": "queued (or, for a repeated Idempotency-Key, the earlier invocation); see Location"},
        **error_responses(
            400, 401, 403, 404, 413, 422, 429,
            s400="X-Function-Args is not JSON, X-Function-Version not a number (or another malformed request)",
            s404="no such function, or it keeps no version X-Function-Version names (version_not_found)",
            s422="X-Function-Args is not an array of strings within its bounds, X-Function-Version out of range, or an "
            "invalid name or header; or X-Callback-Url refused: not an http(s) URL (invalid_callback_url), or its host is "
            "(or resolves to) a loopback, private or other non-public address (callback_url_not_allowed)",
            s429="the tenant's max_queued async invocations are waiting (queue_full, see Retry-After), its stored "
            "bytes are at max_stored_bytes or this input would pass it (storage_quota_exceeded), or its request bodies "
            "in flight in this front reached TENSORWASM_MAX_TENANT_BODY_BYTES (see Retry-After)",
        ),
    },
    openapi_extra={"requestBody": {"content": {"*/*": {"schema": {"type": "string", "format": "binary"}}}}},
)
async def submit_invocation(
    name: NameParam,
    request: Request,
    tenant: TenantDep,
    platform: PlatformDep,
    idempotency_key: Annotated[
        str | None, Header(min_length=1, max_length=255, description="repeat within 24 h to get the same invocation back")
    ] = None,
    x_callback_url: Annotated[
        str | None, Header(min_length=1, max_length=2048, description="POST the final record here when it ends, signed "
                           "(X-TensorWasm-Signature); public addresses only unless the operator allows others")
    ] = None,
) -> Response:
    args = call_args(request)
    callback_url = await check_url(x_callback_url, platform.settings.callback_allow_private) if x_callback_url else None
    version = call_version(request)
    with platform.bodies.hold(tenant.id) as hold:
        body = await read_limited(request, platform.settings.max_request_bytes, hold=hold)
        done = await platform.queue.submit(
            tenant, name, body, request.url.query, request.headers.get("content-type", ""), idempotency_key, args,
            version, callback_url=callback_url,
        )
        if done.created:
            platform.queued(tenant.id)
    inv = done.invocation
    return JSONResponse(
        status_code=202,
        content=invocation_out(inv, done.callback).model_dump(mode="json"),
        headers={"Location": f"/v1/invocations/{inv.id}", "X-Invocation-Id": inv.id},
    )
