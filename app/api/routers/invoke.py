"""POST /v1/functions/{name}/invoke: the hot path, kept apart so it is matched early and
resolves its caller with plain calls rather than FastAPI dependencies (each costs a few tens of
microseconds per request)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.types import Receive

from app.api.body import read_limited
from app.api.call_args import call_args, call_version
from app.api.deps import TENANT_SECURITY, authenticate_tenant
from app.api.errors import CLIENT_CLOSED, error_responses
from app.api.media import safe_media_type
from app.api.routers.functions import NameParam
from app.api.routers.stream import invoke_streaming, stream_kind
from app.api.streaming import SlicedResponse
from app.observability.phases import BODY, WATCH, WHOLE_BYTES, answered, clock, lap
from app.platform import Platform
from app.services.invocations import InvokeService

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
    args = call_args(request)
    version = call_version(request)
    with platform.bodies.hold(tenant.id) as hold:
        body = await read_limited(request, platform.settings.max_request_bytes, hold=hold)
        stream = stream_kind(request)
        if stream is not None:
            return await invoke_streaming(platform, tenant, name, body, request, stream, args, version)
        # a larger body's transfer may have been waited for: the phases time CPU
        t = lap(BODY, t) if len(body) <= WHOLE_BYTES else clock()
        call = asyncio.current_task()
        assert call is not None
        watcher = asyncio.get_running_loop().create_task(_cancel_on_disconnect(request.receive, call))
        lap(WATCH, t)
        service = InvokeService(platform.executor, platform.recorder)
        try:
            outcome = await service.invoke(
                tenant, name, body, request.url.query, request.headers.get("content-type", ""), args, version
            )
        except asyncio.CancelledError:
            if not watcher.done() or watcher.cancelled():
                raise  # not ours: the server is stopping
            call.uncancel()
            return Response(status_code=CLIENT_CLOSED)  # recorded `client_closed`; no one reads this
        finally:
            t = clock()
            watcher.cancel()
            t = lap(WATCH, t)
        headers = {"X-Invocation-Id": outcome.invocation_id}
        response: Response
        if outcome.error is not None:
            response = JSONResponse(status_code=outcome.status, content={"error": outcome.error}, headers=headers)
        else:
            response = SlicedResponse(content=outcome.body, status_code=200, media_type=safe_media_type(outcome.content_type), headers=headers)
        answered(t)
        return response


async def _cancel_on_disconnect(receive: Receive, call: asyncio.Task[object]) -> None:
    """Cancel the call when its client goes away, which stops the guest and frees its worker.
    The body is read by now, so the next ASGI message is the disconnect."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            call.cancel()
            return
