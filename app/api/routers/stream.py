"""The streaming variants of POST /v1/functions/{name}/invoke (chosen by Accept or ?stream=raw)."""

from __future__ import annotations

from typing import Literal

from fastapi import Request, Response

from app.api.streaming import DisconnectAwareStream
from app.contract.messages import Principal
from app.platform import Platform
from app.services.streaming import StreamCall, sse

StreamKind = Literal["sse", "raw"]


def stream_kind(request: Request) -> StreamKind | None:
    if request.query_params.get("stream") == "raw":
        return "raw"
    if "text/event-stream" in request.headers.get("accept", ""):
        return "sse"
    return None


async def invoke_streaming(
    platform: Platform, tenant: Principal, name: str, body: bytes, request: Request, kind: StreamKind,
    args: list[str] | None = None, version: int | None = None,
) -> Response:
    call = StreamCall(platform.executor, platform.recorder, tenant, name, version)
    await call.start(body, request.url.query, request.headers.get("content-type", ""), args)  # refusals: the error handlers
    headers = {"X-Invocation-Id": call.id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if kind == "sse":
        return DisconnectAwareStream(sse(call), media_type="text/event-stream", headers=headers)
    return DisconnectAwareStream(call.chunks(), media_type="application/octet-stream", headers=headers)
