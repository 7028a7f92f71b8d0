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
from app.contract.messages import Principal
from app.observability.phases import AUTH, clock, lap
from app.platform import Platform

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
        platform = self.fastapi.state.platform
        try:
            if path == _ADMIN or path.startswith(_ADMIN + "/"):
                await admit_admin(platform, _authorization(scope), _address(scope))
                scope.setdefault("state", {})["admin"] = True
            else:
                await gate_tenant(platform, scope)
        except Exception as exc:  # a refusal, a disabled tenant, the database out of reach
            response = await handle(self.fastapi, Request(scope, receive), exc)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def gate_tenant(platform: Platform, scope: Scope) -> Principal:
    """The calling tenant from the request's head, left in its state for the route; raises the
    refusal (401, 403, 429)."""
    t = clock()
    header = _authorization(scope)
    principal = cached_tenant(platform, header)
    if principal is None:  # a key not seen lately (read from the database) or a refusal: not timed
        principal = await admit_tenant(platform, header, _address(scope))
    else:
        lap(AUTH, t)
    scope.setdefault("state", {})["principal"] = principal
    return principal


def _authorization(scope: Scope) -> bytes:
    for key, value in scope["headers"]:
        if key == b"authorization":
            return bytes(value)
    return b""


def _address(scope: Scope) -> str | None:
    client = scope.get("client")
    return client[0] if client else None
