"""Read a request body with a hard size limit, never buffering more than the limit."""

from __future__ import annotations

from fastapi import Request

from app.api.errors import ApiError


def _too_large(limit: int, what: str) -> ApiError:
    return ApiError(413, "payload_too_large", f"{what} is larger than the limit of {limit} bytes")


async def read_limited(request: Request, limit: int, what: str = "the request body") -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise _too_large(limit, what)  # refuse before reading a byte
        except ValueError:
            raise ApiError(400, "bad_request", "invalid Content-Length header") from None
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise _too_large(limit, what)
    return bytes(buf)


def require_content_type(request: Request, *allowed: str) -> None:
    got = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if got not in allowed:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"Content-Type must be {' or '.join(allowed)}, got {got or 'none'}",
        )
