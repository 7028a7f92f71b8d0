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


def _count(size: int, limit: int, what: str, hold: BodyHold | None) -> None:
    """A body `size` bytes long so far: refused past the limit, else held as far as it came."""
    if size > limit:
        raise _too_large(limit, what)
    if hold is not None and size > hold.bytes:
        hold.grow(size - hold.bytes)


async def collect_received(
    receive: Receive, declared: str | None, limit: int, what: str = "the request body", hold: BodyHold | None = None,
) -> bytes:
    """`collect_body` straight from the server's `receive`, for the invoke path: no async
    generator between them, and a body that came in one message is returned as it came, not
    copied (a few µs of a front's CPU a call)."""
    _check_declared(declared, limit, what, hold)
    body: bytes | bytearray = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk: bytes = message.get("body", b"")
        if chunk:
            if not body:
                body = chunk
            else:
                if isinstance(body, bytes):
                    body = bytearray(body)
                body += chunk
            _count(len(body), limit, what, hold)
        if not message.get("more_body", False):
            return bytes(body) if isinstance(body, bytearray) else body


async def collect_body(
    chunks: AsyncIterator[bytes], declared: str | None, limit: int, what: str = "the request body", hold: BodyHold | None = None,
) -> bytes:
    """`read_limited` over a body's chunks and its declared Content-Length."""
    _check_declared(declared, limit, what, hold)
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        _count(len(buf), limit, what, hold)
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
