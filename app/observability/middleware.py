"""HTTP metrics by route template, request ids and log context, as plain ASGI (no per-request
task or body wrapping, unlike BaseHTTPMiddleware)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import MutableMapping
from typing import Any

from app.db.ids import new_request_id
from app.observability import context as ctx
from app.observability.metrics import Metrics
from app.observability.phases import METRICS, clock, lap

log = logging.getLogger("tensorwasm.access")

# A client's own request id is kept when it is short and plain (it goes into logs and back into
# the response): up to 128 visible ASCII characters of this set.
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:/+=@-]{1,128}")


def _tenant(scope: MutableMapping[str, Any]) -> str | None:
    """The calling tenant's name: set in the log context when its key was checked (the gate or
    a route's dependency), else the principal the gate left in the scope."""
    name = ctx.tenant.get()
    if name:
        return name
    principal = scope.get("state", {}).get("principal")
    return getattr(principal, "name", None)


def start_request(scope: MutableMapping[str, Any]) -> bytes:
    """A request's id (the client's own when it is short and plain, else a new one), set in the
    log context with the tenant and invocation cleared; returns it for the `X-Request-Id` header."""
    rid = None
    for k, v in scope["headers"]:
        if k == b"x-request-id":
            if _REQUEST_ID.fullmatch(v):  # anything else is replaced, never echoed
                rid = v.decode("ascii")
            break
    rid = rid or new_request_id()
    ctx.request_id.set(rid)
    ctx.tenant.set(None)
    ctx.invocation_id.set(None)
    return rid.encode("latin-1")


def end_request(metrics: Metrics, access_log: bool, scope: MutableMapping[str, Any], template: str, status: int, elapsed: float) -> None:
    """The request counted under its route's template, and its access line."""
    t = clock()
    method = scope["method"]
    metrics.request(method, template, status, elapsed)
    lap(METRICS, t)
    if access_log and log.isEnabledFor(logging.INFO):  # one line per request, once answered (or abandoned)
        log.info("%s %s %d %.1fms tenant=%s", method, template, status, elapsed * 1000, _tenant(scope) or "-")


class ObservabilityMiddleware:
    """Counts each request by method, route template and status; with `access_log` (on by
    default, TENSORWASM_ACCESS_LOG=false turns it off) one `tensorwasm.access` line per request:
    method, route template, status, duration and tenant ("-" for none)."""

    def __init__(self, app: Any, metrics: Metrics, access_log: bool = True) -> None:
        self.app = app
        self.metrics = metrics
        self.access_log = access_log

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        rid_header = (b"x-request-id", start_request(scope))

        async def send_wrapper(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), rid_header]
            await send(message)

        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            end_request(self.metrics, self.access_log, scope, template, status, time.perf_counter() - t0)
