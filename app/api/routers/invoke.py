"""POST /v1/functions/{name}/invoke: the hot path, kept apart so it is matched early and
resolves its caller with plain calls rather than FastAPI dependencies (each costs a few tens of
microseconds per request)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.types import Receive

from app.api.body import read_limited
from app.api.call_args import call_args, call_version
from app.api.deps import TENANT_SECURITY, authenticate_tenant
from app.api.edge import ON_CLIENT_GONE
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
        watch = _Disconnect(request, call)
        lap(WATCH, t)
        service = InvokeService(platform.executor, platform.recorder)
        query = request.scope["query_string"].decode("latin-1")
        try:
            outcome = await service.invoke(tenant, name, body, query, request.headers.get("content-type", ""), args, version)
        except asyncio.CancelledError:
            if not watch.gone:
                raise  # not ours: the server is stopping
            call.uncancel()
            return Response(status_code=CLIENT_CLOSED)  # recorded `client_closed`; no one reads this
        finally:
            t = clock()
            watch.stop()
            t = lap(WATCH, t)
        headers = {"X-Invocation-Id": outcome.invocation_id}
        response: Response
        if outcome.error is not None:
            response = JSONResponse(status_code=outcome.status, content={"error": outcome.error}, headers=headers)
        else:
            response = SlicedResponse(content=outcome.body, status_code=200, media_type=safe_media_type(outcome.content_type), headers=headers)
        answered(t)
        return response


class _Disconnect:
    """Cancels the call when its client goes away, which stops the guest and frees its worker.
    Behind the node's edge it asks to be told (`ON_CLIENT_GONE`, no task of its own); elsewhere a
    task waits on `receive`: the body is read by now, so the next message is the disconnect."""

    __slots__ = ("_call", "_task", "_tell", "gone")

    def __init__(self, request: Request, call: asyncio.Task[Any]) -> None:
        self._call = call
        self._tell: Callable[[Callable[[], None] | None], None] | None = request.scope.get(ON_CLIENT_GONE)
        self._task: asyncio.Task[None] | None = None
        self.gone = False
        if self._tell is not None:
            self._tell(self._cancel)
        else:
            self._task = asyncio.get_running_loop().create_task(self._wait(request.receive))

    def _cancel(self) -> None:
        self.gone = True
        self._call.cancel()

    async def _wait(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._cancel()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        elif self._tell is not None:
            self._tell(None)
