"""The floor of the node's shape: a bare FastAPI app that hands each body to another process.

DESIGN.md puts a call's bytes in a worker process apart from the HTTP front. This baseline does
only that and nothing of the project: the `/echo` route sends the body over a unix socket (a
4-byte length, then the bytes) to a plain echo process and answers with what comes back. What it
costs above `app.bench.echo_app` is the price of one process hop, paid by any design that keeps
tenant code out of the HTTP process; what the node costs above it is the node's own.

    python -m app.bench.relay_app PATH          # the echo process, serving the unix socket PATH
    TENSORWASM_BENCH_RELAY=PATH uvicorn app.bench.relay_app:app --workers N
"""

from __future__ import annotations

import asyncio
import os
import struct
import sys

from fastapi import FastAPI, Request, Response

LEN = struct.Struct("!I")
app = FastAPI()
_idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []


async def _exchange(body: bytes) -> bytes:
    conn = _idle.pop() if _idle else await asyncio.open_unix_connection(os.environ["TENSORWASM_BENCH_RELAY"])
    reader, writer = conn
    writer.write(LEN.pack(len(body)) + body)
    (n,) = LEN.unpack(await reader.readexactly(LEN.size))
    reply = await reader.readexactly(n)
    _idle.append(conn)  # a connection that failed mid-call is dropped with its exception
    return reply


@app.post("/echo")
async def echo(request: Request) -> Response:
    return Response(await _exchange(await request.body()), media_type="application/octet-stream")


async def _serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readexactly(LEN.size)
            writer.write(head + await reader.readexactly(LEN.unpack(head)[0]))
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def _serve(path: str) -> None:
    server = await asyncio.start_unix_server(_serve_one, path)
    async with server:
        await server.serve_forever()


def main() -> None:
    import uvloop  # what uvicorn runs the HTTP side on, so both ends pay the same loop

    uvloop.run(_serve(sys.argv[1]))


if __name__ == "__main__":
    main()
