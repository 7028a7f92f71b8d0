"""A plain invoke call straight to its endpoint, past FastAPI's routing and request handling.

Those cost ~85 µs a request on the 2-core dev VM (under wrk, a raw ASGI echo served 36k
requests/s where the FastAPI echo served 8.8k): a sixth of a front's work per call. Only a
`POST /v1/functions/{name}/invoke` with a valid name and no streaming takes this path; anything
else, and every request while tracing is on (its instrumentation wraps the app), goes through
FastAPI as before. Errors map through the app's own exception handlers, so both paths answer
alike; one that has none propagates to the server-error handler outside, as from a route.
"""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.errors import handle
from app.api.routers.invoke import invoke_function, router
from app.api.schemas import NAME_PATTERN
from app.observability.phases import RESPOND, WHOLE_BYTES, clock, lap

_PREFIX, _SUFFIX = "/v1/functions/", "/invoke"
_TEMPLATE = f"{_PREFIX}{{name}}{_SUFFIX}"
_NAME = re.compile(NAME_PATTERN)


class InvokeFastPath:
    def __init__(self, app: ASGIApp, fastapi: FastAPI) -> None:
        self.app = app
        self.fastapi = fastapi
        self.traced = fastapi.state.tracing.enabled  # set once, when the app is made
        # the metrics label a request by its route's template (app/observability/middleware.py)
        self.route = next(r for r in router.routes if getattr(r, "path", None) == _TEMPLATE)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = self._plain_invoke(scope)
        if name is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = self.route
        request = Request(scope, receive)
        try:
            response = await invoke_function(name, request)
        except Exception as exc:
            response = await handle(self.fastapi, request, exc)
        t = clock()
        await response(scope, receive, send)
        if len(response.body) <= WHOLE_BYTES:  # written at once; a larger one may wait for its client
            lap(RESPOND, t)

    def _plain_invoke(self, scope: Scope) -> str | None:
        """The function's name when this request takes the fast path, else None."""
        if scope["type"] != "http" or scope["method"] != "POST" or self.traced:
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
