"""The fronts' shared listening socket (app/node/accept.py): a burst of connections spreads over
the fronts instead of landing on whichever woke first, and each connection is served."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn

from app.node.accept import SharedPortServer


async def _hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@asynccontextmanager
async def _fronts(n: int) -> AsyncIterator[tuple[int, list[SharedPortServer]]]:
    """`n` servers in this loop, each on its own descriptor of one listening socket, as the
    fronts each inherit the supervisor's."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    servers = [
        SharedPortServer(uvicorn.Config(_hello, lifespan="off", log_config=None), listener.dup())
        for _ in range(n)
    ]
    tasks = [asyncio.create_task(s._serve()) for s in servers]  # serve() would take over the signals
    try:
        async with asyncio.timeout(10):
            while not all(s.started for s in servers):
                await asyncio.sleep(0.01)
        yield listener.getsockname()[1], servers
    finally:
        for s in servers:
            s.should_exit = True
        await asyncio.gather(*tasks)
        listener.close()


async def _get(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert await reader.readexactly(2) == b"ok"
    return reader, writer


async def test_a_burst_of_connections_spreads_over_the_fronts() -> None:
    async with _fronts(4) as (port, servers):
        conns = await asyncio.gather(*(_get(port) for _ in range(16)))
        held = sorted(len(s.server_state.connections) for s in servers)
        assert sum(held) == 16
        # accepting every pending connection at once, the first front to wake took them all
        assert held[0] >= 2 and held[-1] <= 7, held
        for _, writer in conns:
            writer.close()


async def test_a_front_alone_on_the_socket_serves_every_connection() -> None:
    async with _fronts(1) as (port, [server]):
        conns = await asyncio.gather(*(_get(port) for _ in range(20)))
        assert len(server.server_state.connections) == 20
        for _, writer in conns:
            writer.close()
