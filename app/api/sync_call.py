"""One synchronous invoke call as the HTTP layer runs it: the call's own headers read once from
the request's raw head, its body read within its limits, the call, and the answer. The FastAPI
route (app/api/routers/invoke.py) and the fast path (app/api/fastpath.py) share it; the fast
path sends a successful answer without Starlette's Request and Response objects, which cost a
front more per call than the rest of its HTTP work (app/api/fastpath.py says how much).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from app.api.body import collect_received
from app.api.call_args import HEADER as ARGS_HEADER
from app.api.call_args import VERSION_HEADER, parse_args, parse_version
from app.api.edge import ON_CLIENT_GONE, RESPOND_NOW
from app.api.errors import CLIENT_CLOSED
from app.api.media import safe_media_type
from app.api.streaming import SlicedResponse, send_sliced
from app.contract.messages import Principal
from app.observability.phases import BODY, WATCH, WHOLE_BYTES, clock, lap
from app.platform import Platform
from app.services.invocations import InvokeOutcome, InvokeService

_ARGS, _VERSION = ARGS_HEADER.encode(), VERSION_HEADER.encode()


@dataclass(frozen=True, slots=True)
class CallHead:
    """What a call's head says about the call. Built from the raw header list as Starlette's
    `Headers.get` reads it (names arrive lowercased; the first of a repeated header counts)."""

    name: str
    query: str
    content_type: str
    content_length: str | None
    args: list[str] | None
    version: int | None

    @classmethod
    def of(cls, scope: Scope, name: str) -> CallHead:
        """400 or 422 (ApiError) for arguments or a version the call cannot run with."""
        length = ctype = args = version = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                length = length if length is not None else value
            elif key == b"content-type":
                ctype = ctype if ctype is not None else value
            elif key == _ARGS:
                args = args if args is not None else value
            elif key == _VERSION:
                version = version if version is not None else value
        return cls(
            name=name,
            query=scope["query_string"].decode("latin-1"),
            content_type=ctype.decode("latin-1") if ctype is not None else "",
            content_length=length.decode("latin-1") if length is not None else None,
            args=parse_args(args.decode("latin-1")) if args is not None else None,
            version=parse_version(version.decode("latin-1")) if version is not None else None,
        )


async def run_call(platform: Platform, tenant: Principal, head: CallHead, scope: Scope, receive: Receive) -> InvokeOutcome | None:
    """The call's body read and the call run and recorded; None when its client went away
    before the answer (recorded `client_closed`)."""
    t = clock()
    with platform.bodies.hold(tenant.id) as hold:
        body = await collect_received(receive, head.content_length, platform.settings.max_request_bytes, hold=hold)
        # a larger body's transfer may have been waited for: the phases time CPU
        t = lap(BODY, t) if len(body) <= WHOLE_BYTES else clock()
        call = asyncio.current_task()
        assert call is not None
        watch = _Disconnect(scope, receive, call)
        lap(WATCH, t)
        service = InvokeService(platform.executor, platform.recorder)
        try:
            return await service.invoke(tenant, head.name, body, head.query, head.content_type, head.args, head.version)
        except asyncio.CancelledError:
            if not watch.gone:
                raise  # not ours: the server is stopping
            call.uncancel()
            return None
        finally:
            t = clock()
            watch.stop()
            lap(WATCH, t)


def outcome_response(outcome: InvokeOutcome | None) -> Response:
    """The answer as a Starlette response (the route's, and every fast-path answer but a success)."""
    if outcome is None:
        return Response(status_code=CLIENT_CLOSED)  # no one reads this
    headers = {"X-Invocation-Id": outcome.invocation_id}
    if outcome.error is not None:
        return JSONResponse(status_code=outcome.status, content={"error": outcome.error}, headers=headers)
    return SlicedResponse(content=outcome.body, status_code=200, media_type=safe_media_type(outcome.content_type), headers=headers)


@lru_cache(maxsize=1024)  # one entry per content type functions declare
def content_type_header(declared: str) -> bytes:
    """The Content-Type a success answers with, as Starlette's Response writes it."""
    value = safe_media_type(declared)
    if value.startswith("text/") and "charset=" not in value.lower():
        value += "; charset=utf-8"
    return value.encode("latin-1")


async def send_outcome(outcome: InvokeOutcome | None, scope: Scope, receive: Receive, send: Send, extra: tuple[bytes, bytes]) -> int:
    """The answer sent with one more header (`extra`); returns its status."""
    if outcome is None or outcome.error is not None:
        response = outcome_response(outcome)
        response.raw_headers.append(extra)
        await response(scope, receive, send)
        return response.status_code
    headers = [
        (b"x-invocation-id", outcome.invocation_id.encode("latin-1")),
        (b"content-type", content_type_header(outcome.content_type)),
        extra,
    ]
    respond_now = scope.get(RESPOND_NOW)  # behind the node's edge: written at once
    if respond_now is not None and len(outcome.body) <= WHOLE_BYTES and respond_now(200, headers, outcome.body):
        return 200
    headers.append((b"content-length", b"%d" % len(outcome.body)))
    await send_sliced(send, 200, headers, outcome.body)
    return 200


class _Disconnect:
    """Cancels the call when its client goes away, which stops the guest and frees its worker.
    Behind the node's edge it asks to be told (`ON_CLIENT_GONE`, no task of its own); elsewhere a
    task waits on `receive`: the body is read by now, so the next message is the disconnect."""

    __slots__ = ("_call", "_task", "_tell", "gone")

    def __init__(self, scope: Scope, receive: Receive, call: asyncio.Task[Any]) -> None:
        self._call = call
        self._tell: Callable[[Callable[[], None] | None], None] | None = scope.get(ON_CLIENT_GONE)
        self._task: asyncio.Task[None] | None = None
        self.gone = False
        if self._tell is not None:
            self._tell(self._cancel)
        else:
            self._task = asyncio.get_running_loop().create_task(self._wait(receive))

    def _cancel(self) -> None:
        self.gone = True
        self._call.cancel()

    async def _wait(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._cancel()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        elif self._tell is not None:
            self._tell(None)
