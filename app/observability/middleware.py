"""HTTP metrics by route template, request ids and log context, as plain ASGI (no per-request
task or body wrapping, unlike BaseHTTPMiddleware)."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from app.observability import context as ctx
from app.observability.metrics import Metrics

log = logging.getLogger("tensorwasm.access")


class ObservabilityMiddleware:
    def __init__(self, app: Any, metrics: Metrics, access_log: bool = False) -> None:
        self.app = app
        self.metrics = metrics
        self.access_log = access_log

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                rid = v.decode("latin-1")[:128]
                break
        rid = rid or os.urandom(8).hex()
        ctx.request_id.set(rid)
        ctx.tenant.set(None)
        ctx.invocation_id.set(None)
        status = 500
        rid_header = (b"x-request-id", rid.encode("latin-1"))

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
            elapsed = time.perf_counter() - t0
            method = scope["method"]
            m = self.metrics
            m.child(m.http_requests, method, template, str(status)).inc()
            m.child(m.http_seconds, method, template).observe(elapsed)
            if self.access_log:
                log.info("%s %s %d %.1fms", method, scope["path"], status, elapsed * 1000)
