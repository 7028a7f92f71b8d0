"""POST /v1/functions/{name}/invoke: the hot path, kept apart so it is matched early and
resolves its caller with plain calls rather than FastAPI dependencies (each costs a few tens of
microseconds per request)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from app.api.body import read_limited
from app.api.deps import authenticate_tenant
from app.api.routers.functions import NameParam
from app.platform import Platform
from app.services.invocations import InvokeService

router = APIRouter(prefix="/v1/functions", tags=["functions"])


@router.post(
    "/{name}/invoke",
    operation_id="invoke_function",
    response_class=Response,
    responses={
        200: {"description": "the guest's stdout", "content": {"application/octet-stream": {}}},
        429: {"description": "concurrency or rate limit; see Retry-After"},
        500: {"description": "guest_error, output_limit_exceeded, device_error, worker_crashed or internal"},
        504: {"description": "the invocation exceeded its time limit"},
    },
    openapi_extra={
        "requestBody": {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}
    },
)
async def invoke_function(name: NameParam, request: Request) -> Response:
    platform: Platform = request.app.state.platform
    tenant = await authenticate_tenant(request, platform)
    body = await read_limited(request, platform.settings.max_request_bytes)
    service = InvokeService(
        platform.settings, platform.function_cache, platform.node, platform.recorder, platform.metrics, platform.tracing
    )
    outcome = await service.invoke(
        tenant, name, body, request.url.query, request.headers.get("content-type", "")
    )
    headers = {"X-Invocation-Id": outcome.invocation_id, **(outcome.headers or {})}
    if outcome.error is not None:
        return JSONResponse(status_code=outcome.status, content={"error": outcome.error}, headers=headers)
    return Response(content=outcome.body, status_code=200, media_type=outcome.content_type, headers=headers)
