"""Responses that never leave the server a second copy of a large body."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Mapping

import anyio
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from app.contract.frames import Payload
from app.services.streaming import SLICE, slices


async def send_sliced(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: Payload | memoryview) -> None:
    """A whole answer (its Content-Length among `headers`), its body in slices of at most SLICE
    bytes, each sent once the server took the previous one."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    if len(body) <= SLICE:
        await send({"type": "http.response.body", "body": body})
        return
    end = len(body)
    for i, piece in enumerate(slices(body), 1):
        await send({"type": "http.response.body", "body": piece, "more_body": i * SLICE < end})


class SlicedResponse(Response):
    """A Response whose body goes out as `send_sliced` sends it."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if len(self.body) <= SLICE:
            await super().__call__(scope, receive, send)
            return
        await send_sliced(send, self.status_code, self.raw_headers, self.body)
        if self.background is not None:
            await self.background()


class DisconnectAwareStream(StreamingResponse):
    """Starlette skips listening for `http.disconnect` on newer ASGI servers and relies on a
    failed send, which a silent guest never triggers; this always listens, so a disconnect
    cancels the body iterator (and with it the guest) at once."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass
                tg.cancel_scope.cancel()

            async def listen() -> None:
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            tg.start_soon(listen)


class StoredOutputResponse(DisconnectAwareStream):
    """A stored output of `size` bytes (its Content-Length up front), read a piece at a time as
    it is sent, each piece in slices: a front holds a piece, not the output."""

    def __init__(self, pieces: AsyncIterable[bytes], size: int, media_type: str, headers: Mapping[str, str]) -> None:
        super().__init__(_sliced(pieces), media_type=media_type, headers={**headers, "Content-Length": str(size)})


async def _sliced(pieces: AsyncIterable[bytes]) -> AsyncIterator[bytes | memoryview]:
    async for piece in pieces:
        for part in slices(piece):
            yield part
