"""GET /v1/functions/{name}/logs: the stderr lines of a function's calls, once or followed (SSE)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query, Response

from app.api.deps import PlatformDep, TenantDep
from app.api.errors import error_responses
from app.api.routers.functions import NameParam
from app.api.schemas import LogLineOut, LogPage
from app.api.streaming import DisconnectAwareStream
from app.services.logs import LogLine

router = APIRouter(prefix="/v1/functions", tags=["logs"])

KEEPALIVE_S = 15.0  # a comment line this often on a quiet stream: proxies keep it open, a gone client is noticed


def line_out(x: LogLine) -> LogLineOut:
    return LogLineOut(invocation_id=x.invocation_id, version=x.version, time=x.time, line=x.line)


@router.get(
    "/{name}/logs",
    operation_id="function_logs",
    response_model=LogPage,
    responses={
        200: {
            "description": "the last `limit` lines the function's calls wrote to stderr, oldest first; with `follow=1` a "
            "`text/event-stream` instead: those lines, then new ones as calls end, each an `event: log` whose data is one "
            "line's JSON object (invocation_id, version, time, line), and a `: keep-alive` comment when quiet",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
        **error_responses(401, 403, 404, 422, s404="no such function (or another tenant's)", s422="limit out of range, or an invalid name"),
    },
)
async def function_logs(
    name: NameParam,
    tenant: TenantDep,
    platform: PlatformDep,
    follow: Annotated[bool, Query(description="stream the lines as server-sent events, and new ones as calls end")] = False,
    limit: Annotated[int, Query(ge=1, le=10_000, description="the newest lines to show first")] = 100,
) -> Response:
    """Lines of calls of every front and node, kept within the tenant's log budget
    (TENSORWASM_LOG_BYTES_PER_TENANT), the oldest deleted first. A line reaches a follower within
    about a second of its call's end."""
    if not follow:
        lines = await platform.logs.recent(tenant, name, limit)
        return Response(LogPage(lines=[line_out(x) for x in lines]).model_dump_json(), media_type="application/json")
    stream = platform.logs.follow(tenant, name, limit)
    first = await anext(stream)  # an unknown function is a 404 here, before the stream starts
    return DisconnectAwareStream(
        _events(first, stream), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def _events(first: list[LogLine], rest: AsyncIterator[list[LogLine]]) -> AsyncIterator[bytes]:
    quiet_since = time.monotonic()
    batch = first
    try:
        while True:
            if batch:
                quiet_since = time.monotonic()
                yield b"".join(b"event: log\ndata: " + json.dumps(line_out(x).model_dump(mode="json")).encode() + b"\n\n" for x in batch)
            elif time.monotonic() - quiet_since >= KEEPALIVE_S:
                quiet_since = time.monotonic()
                yield b": keep-alive\n\n"
            batch = await anext(rest)
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
