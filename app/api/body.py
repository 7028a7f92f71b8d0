"""Read a request body with a hard size limit, never buffering more than the limit."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive

from app.api.errors import ApiError
from app.services.body_budget import BodyHold


def _too_large(limit: int, what: str) -> ApiError:
    return ApiError(413, "payload_too_large", f"{what} is larger than the limit of {limit} bytes")


async def read_limited(request: Request, limit: int, what: str = "the request body", hold: BodyHold | None = None) -> bytes:
    """The whole body, at most `limit` bytes; with `hold`, counted against the tenant's bodies in
    flight (the declared length before a byte is read, then whatever arrives past it)."""
    return await collect_body(request.stream(), request.headers.get("content-length"), limit, what, hold)


def _check_declared(declared: str | None, limit: int, what: str, hold: BodyHold | None) -> None:
    """A declared Content-Length: refused past the limit before a byte is read, else held."""
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ApiError(400, "bad_request", "invalid Content-Length header") from None
        if size > limit:
            raise _too_large(limit, what)  # refuse before reading a byte
        if hold is not None and size > 0:
            hold.grow(size)


async def collect_received(
    receive: Receive, declared: str | None, limit: int, what: str = "the request body", hold: BodyHold | None = None,
) -> bytes:
    """`collect_body` straight from the server's `receive`, for the invoke path: no async
    generator between them, and a body that came in one message is returned as it came, not
    copied (a few µs of a front's CPU a call)."""
    _check_declared(declared, limit, what, hold)
    first: bytes | None = None
    buf: bytearray | None = None
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk: bytes = message.get("body", b"")
        if chunk:
            if first is None and buf is None:
                first = chunk
            else:
                if buf is None:
                    buf, first = bytearray(first or b""), None
                buf += chunk
            size = len(buf) if buf is not None else len(chunk)
            if size > limit:
                raise _too_large(limit, what)
            if hold is not None and size > hold.bytes:
                hold.grow(size - hold.bytes)
        if not message.get("more_body", False):
            break
    if buf is not None:
        return bytes(buf)
    return first if first is not None else b""


async def collect_body(
    chunks: AsyncIterator[bytes], declared: str | None, limit: int, what: str = "the request body", hold: BodyHold | None = None,
) -> bytes:
    """`read_limited` over a body's chunks and its declared Content-Length."""
    _check_declared(declared, limit, what, hold)
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        if len(buf) > limit:
            raise _too_large(limit, what)
        if hold is not None and len(buf) > hold.bytes:
            hold.grow(len(buf) - hold.bytes)
    return bytes(buf)


def require_content_type(request: Request, *allowed: str) -> None:
    got = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if got not in allowed:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"Content-Type must be {' or '.join(allowed)}, got {got or 'none'}",
        )


class LimitedBodyRoute(APIRoute):
    """A route whose body FastAPI parses (JSON) reads it with the app-wide limit
    (`TENSORWASM_MAX_JSON_BYTES`) before FastAPI sees it: a declared Content-Length over the limit
    is refused at once, a chunked body as soon as it passes the limit, and both before the
    caller's credentials are even looked at (FastAPI reads the body before resolving them).
    Routes that read a raw body themselves (deploy, invoke, kernels) have no body field and are
    left alone: they apply their own limits with `read_limited`.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def limited(request: Request) -> Response:
            limit = request.app.state.settings.max_json_bytes
            body = await read_limited(request, limit)
            receive = request.receive
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            return await handler(Request(request.scope, replay))

        return limited
