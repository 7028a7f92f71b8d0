"""A plain invoke call served straight from the server's ASGI call, ahead of FastAPI.

FastAPI's routing and request handling cost ~85 µs a request on the 2-core dev VM (under wrk, a
raw ASGI echo served 36k requests/s where the FastAPI echo served 8.8k), and the middleware
layers around every app (FastAPI's own error, telemetry and body-limit layers, this app's
observability and auth gate, each wrapping the call and its `send`) a few µs each. So the fast
path sits outside them all and does what they would do for this one request, from the same
functions: the request id and access line (app/observability/middleware.py), the key check
before the body (app/api/gate.py), and the call (app/api/sync_call.py), whose success it sends as
raw ASGI messages. Only a `POST /v1/functions/{name}/invoke` with a valid name and no streaming
takes it; anything else goes through FastAPI as before, and while tracing is on the app does not
install it (app/main.py: its instrumentation wraps FastAPI's own stack). Errors map through the
app's own exception handlers, so both paths answer alike; one that has none is answered by the
app's handler for Exception and raised again, as FastAPI's server-error layer does.
"""

from __future__ import annotations

import re
import time

from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.errors import handle, handler_for
from app.api.gate import gate_tenant
from app.api.routers.invoke import router
from app.api.schemas import NAME_PATTERN
from app.api.sync_call import CallHead, run_call, send_outcome
from app.node.spin import AWAKE
from app.observability.middleware import end_request, start_request
from app.observability.phases import RESPOND, WHOLE_BYTES, answered, clock, lap

_PREFIX, _SUFFIX = "/v1/functions/", "/invoke"
_TEMPLATE = f"{_PREFIX}{{name}}{_SUFFIX}"
_NAME = re.compile(NAME_PATTERN)


class InvokeFastPath:
    def __init__(self, app: ASGIApp, fastapi: FastAPI) -> None:
        self.app = app
        self.fastapi = fastapi
        # the metrics label a request by its route's template (app/observability/middleware.py)
        self.route = next(r for r in router.routes if getattr(r, "path", None) == _TEMPLATE)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = self._plain_invoke(scope)
        if name is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = self.route
        state = self.fastapi.state
        rid = (b"x-request-id", start_request(scope))
        status = 500
        t0 = time.perf_counter()
        try:
            try:
                tenant = await gate_tenant(state.platform, scope)
                head = CallHead.of(scope, name)
                outcome = await run_call(state.platform, tenant, head, scope, receive)
            except Exception as exc:
                status = await self._answer_error(exc, scope, receive, send, rid)
                return
            # a failure while answering is not answered again (its answer may have started)
            t = clock()
            status = await send_outcome(outcome, scope, receive, send, rid)
            if outcome is not None and len(outcome.body) <= WHOLE_BYTES:  # written at once; a larger one may wait for its client
                answered(t)
            AWAKE.poke()  # the client's next request read as it lands
        finally:
            end_request(state.metrics, state.settings.access_log, scope, _TEMPLATE, status, time.perf_counter() - t0)

    async def _answer_error(self, exc: Exception, scope: Scope, receive: Receive, send: Send, rid: tuple[bytes, bytes]) -> int:
        """`exc` answered by the app's handler for it; one with none by the handler for
        Exception (a 500), then raised again for the server to log."""
        response = await handle(self.fastapi, Request(scope, receive), exc, last_resort=True)
        response.raw_headers.append(rid)
        t = clock()
        await response(scope, receive, send)
        if handler_for(self.fastapi, exc) is None:
            raise exc
        lap(RESPOND, t)
        return response.status_code

    def _plain_invoke(self, scope: Scope) -> str | None:
        """The function's name when this request takes the fast path, else None."""
        if scope["type"] != "http" or scope["method"] != "POST":
            return None
        path: str = scope["path"]
        if not (path.startswith(_PREFIX) and path.endswith(_SUFFIX)):
            return None
        name = path[len(_PREFIX) : -len(_SUFFIX)]
        if not _NAME.fullmatch(name) or b"stream" in scope["query_string"]:
            return None  # FastAPI answers a bad name (422) and serves streams
        for key, value in scope["headers"]:
            if key == b"accept" and b"text/event-stream" in value:
                return None
        return name
