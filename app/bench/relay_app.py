"""The floor of the node's shape: a bare FastAPI app that hands each body to another process.

A node puts a call's bytes in a worker process apart from the HTTP front (docs/architecture.md,
"The node"). This baseline does
only that and nothing of the project: the `/echo` route sends the body over a unix socket (a
4-byte length, then the bytes) to a plain echo process and answers with what comes back. What it
costs above `app.bench.echo_app` is the price of one process hop, paid by any design that keeps
tenant code out of the HTTP process; what the node costs above it is the node's own.

With `--guest` the far process runs the echo guest on each body as a worker does (the project's
runner on the CPU backend, its instance built ahead after each reply) and answers with its
stdout: the floor of a node that runs the guest, with none of the node's own work (no auth, no
lease, no limits, no record, no metrics). Several far processes, like a node's workers, are named
with commas; each call goes to the one with the fewest calls in flight from its app process,
the first on a tie (so a lone connection keeps using one warm far process, as the node keeps
using a tenant's first idle worker). `/echo/plain` takes the same hop to the same far process,
which answers it without running the guest: calls of both routes alternated on one connection
time the guest's run against the very hop it rides on (`bench invoke`, the floor less its hop).

    python -m app.bench.relay_app PATH [--guest]    # a far process, serving the unix socket PATH
    TENSORWASM_BENCH_RELAY=PATH[,PATH...] uvicorn app.bench.relay_app:app --workers N
"""

from __future__ import annotations

import argparse
import asyncio
import os
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI, Request, Response

LEN = struct.Struct("!I")
PLAIN = 1 << 31  # in a request's length word: answer with the body as it is, not the guest's run
app = FastAPI()
_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]
_paths = os.environ.get("TENSORWASM_BENCH_RELAY", "").split(",")
_idle: dict[str, list[_Conn]] = {path: [] for path in _paths}
_busy = dict.fromkeys(_paths, 0)  # this process's calls in flight on each far process


async def _exchange(body: bytes, plain: bool = False) -> bytes:
    # the far process with the fewest of this process's calls, the first of them on a tie: as
    # the node's scheduler takes a tenant's first idle worker, one connection keeps one warm
    path = min(_paths, key=_busy.__getitem__)
    _busy[path] += 1
    try:
        idle = _idle[path]
        conn = idle.pop() if idle else await asyncio.open_unix_connection(path)
        reader, writer = conn
        writer.write(LEN.pack(len(body) | (PLAIN if plain else 0)) + body)
        (n,) = LEN.unpack(await reader.readexactly(LEN.size))
        reply = await reader.readexactly(n)
        idle.append(conn)  # a connection that failed mid-call is dropped with its exception
        return reply
    finally:
        _busy[path] -= 1


@app.post("/echo")
async def echo(request: Request) -> Response:
    return Response(await _exchange(await request.body()), media_type="application/octet-stream")


@app.post("/echo/plain")
async def echo_plain(request: Request) -> Response:
    return Response(await _exchange(await request.body(), plain=True), media_type="application/octet-stream")


def _serving(answer: Callable[[bytes], bytes], after: Callable[[], None]) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (n,) = LEN.unpack(await reader.readexactly(LEN.size))
                body = await reader.readexactly(n & ~PLAIN)
                if n & PLAIN:
                    writer.write(LEN.pack(len(body)) + body)
                    continue
                out = answer(body)
                writer.write(LEN.pack(len(out)) + out)
                after()  # after the reply, off the caller's path, as a worker does
        except (asyncio.IncompleteReadError, ConnectionError, RuntimeError):  # RuntimeError: a failed guest
            writer.close()

    return serve_one


async def _serve(path: str, guest: bool) -> None:
    if guest:
        from app.bench.guest_call import EchoGuest
        from app.gpu.cpu import CpuBackend

        work = Path(path).with_suffix(".work")  # beside the socket, in the directory its starter removes
        work.mkdir(exist_ok=True)
        echo = EchoGuest(CpuBackend(), work)
        handler = _serving(echo.run, echo.after)
    else:
        handler = _serving(bytes, lambda: None)
    server = await asyncio.start_unix_server(handler, path)
    async with server:
        await server.serve_forever()


def main() -> None:
    import uvloop  # what uvicorn runs the HTTP side on, so both ends pay the same loop

    parser = argparse.ArgumentParser(prog="python -m app.bench.relay_app")
    parser.add_argument("path", help="the unix socket to serve")
    parser.add_argument("--guest", action="store_true", help="run the echo guest on each body, as a worker does")
    args = parser.parse_args()
    uvloop.run(_serve(args.path, args.guest))


if __name__ == "__main__":
    main()
