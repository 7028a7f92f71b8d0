"""A streaming response that notices a client going away even while nothing is being sent."""

from __future__ import annotations

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


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
