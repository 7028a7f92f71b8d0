"""POST /v1/functions/{name}/invoke: the hot path, kept apart so it is matched early and
resolves its caller with plain calls rather than FastAPI dependencies (each costs a few tens of
microseconds per request)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from app.api.body import read_limited
from app.api.deps import TENANT_SECURITY, authenticate_tenant
from app.api.errors import error_responses
from app.api.routers.functions import NameParam
from app.api.routers.stream import invoke_streaming, stream_kind
from app.api.sync_call import CallHead, outcome_response, run_call
from app.observability.phases import BODY, answered, clock, lap
from app.platform import Platform

router = APIRouter(prefix="/v1/functions", tags=["functions"])


@router.post(
    "/{name}/invoke",
    operation_id="invoke_function",
    response_class=Response,
    responses={
        200: {
            "description": "the guest's stdout, with the function's content type; with `Accept: text/event-stream` "
            "a stream of `output` events and one `end` event; with `?stream=raw` the raw stdout bytes, chunked, as written",
            "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}, "text/event-stream": {"schema": {"type": "string"}}},
        },
        **error_responses(
            400, 401, 403, 404, 413, 422, 429, 500, 503, 504,
            s400="X-Function-Args is not JSON, X-Function-Version not a number (or another malformed request)",
            s404="no such function, or it keeps no version X-Function-Version names (version_not_found)",
            s422="X-Function-Args is not an array of strings within its bounds, X-Function-Version out of range, or an "
            "invalid name",
            s500="guest_error (with exit_code and stderr_tail), output_limit_exceeded, device_error, worker_crashed or internal",
        ),
    },
    openapi_extra={
        "requestBody": {"content": {"*/*": {"schema": {"type": "string", "format": "binary"}}}},
        "security": TENANT_SECURITY,
    },
)
async def invoke_function(name: NameParam, request: Request) -> Response:
    platform: Platform = request.app.state.platform
    tenant = await authenticate_tenant(request, platform)
    t = clock()
    head = CallHead.of(request.scope, name)
    stream = stream_kind(request)
    if stream is not None:
        with platform.bodies.hold(tenant.id) as hold:
            body = await read_limited(request, platform.settings.max_request_bytes, hold=hold)
            return await invoke_streaming(platform, tenant, name, body, request, stream, head.args, head.version)
    lap(BODY, t)
    outcome = await run_call(platform, tenant, head, request.scope, request.receive)
    t = clock()
    response = outcome_response(outcome)
    if outcome is not None:
        answered(t)
    return response
