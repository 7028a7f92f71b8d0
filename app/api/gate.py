"""Credentials before bodies: every `/v1` request is authenticated from its head alone, before
anything reads its body.

FastAPI reads a JSON body before it resolves a route's dependencies, so an unauthenticated
caller could make a front hold a body per connection. Here `/v1/admin/...` needs the admin
token and every other `/v1/...` a tenant key; a refusal is answered at once, and the edge
protocol (app/api/edge.py) closes a connection answered before its body arrived. The tenant
found is left in the request's state for the route's dependency (no second lookup).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.deps import admit_admin, admit_tenant, cached_tenant
from app.api.errors import handle
from app.observability.phases import AUTH, clock, lap

_V1, _ADMIN = "/v1/", "/v1/admin"


class AuthGate:
    def __init__(self, app: ASGIApp, fastapi: FastAPI) -> None:
        self.app = app
        self.fastapi = fastapi

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(_V1):
            await self.app(scope, receive, send)
            return
        t = clock()
        platform = self.fastapi.state.platform
        header = b""
        for key, value in scope["headers"]:
            if key == b"authorization":
                header = value
                break
        client = scope.get("client")
        address = client[0] if client else None
        try:
            if path == _ADMIN or path.startswith(_ADMIN + "/"):
                await admit_admin(platform, header, address)
                scope.setdefault("state", {})["admin"] = True
            else:
                principal = cached_tenant(platform, header)
                if principal is None:  # a key not seen lately (read from the database) or a refusal: not timed
                    principal = await admit_tenant(platform, header, address)
                else:
                    lap(AUTH, t)
                scope.setdefault("state", {})["principal"] = principal
        except Exception as exc:  # a refusal, a disabled tenant, the database out of reach
            response = await handle(self.fastapi, Request(scope, receive), exc)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
