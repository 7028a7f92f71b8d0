"""Attackers for the edge tests, each run as its own process (`python -m tests.hostile.attack
KIND ...`) so that thousands of sockets count against its descriptor limit, not the test's. Each
prints one JSON line of what it saw, then exits. Every loop is bounded by `--seconds`.

- `slow`: holds `--count` connections that never finish their head (a byte now and then), and
  opens a new one for each the node closes; reports how long it saw each live (late by as much
  as its own loop lags, with thousands of sockets on a busy core). The first connections are
  spread over `--ramp` seconds: all at once they are a SYN flood, which the kernel meets by
  dropping SYNs past the listen queue (a 1 s retransmit for everyone, the tenant too) before
  the node sees them.
- `header`: an endless header value, sent as fast as the socket takes it until the node refuses
  it; then, after a pause (`--pause`), the same again on a new connection.
- `bodies`: `--count` unauthenticated POSTs that declare 1 MiB and send all but one byte of it,
  held open; reports each answer and how many body bytes were written before it.
- `bogus`: requests with keys that do not exist, on `--count` keep-alive connections.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import secrets
import time
from typing import Any


async def _open(host: str, port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(host, port, local_addr=(source, 0))


async def slow(args: argparse.Namespace) -> dict[str, Any]:
    end = time.monotonic() + args.seconds
    lived: list[float] = []
    opened = failed = 0
    held: set[asyncio.StreamWriter] = set()

    async def trickle() -> None:
        # one task for every connection's byte (a timer per connection would take this process's
        # core, and its loop's lag would be what the test measures)
        while time.monotonic() < end:
            await asyncio.sleep(1.0)
            for writer in list(held):
                writer.write(b"x")  # never the end of the head

    async def one(i: int) -> None:
        nonlocal opened, failed
        await asyncio.sleep(args.ramp * i / args.count)
        while time.monotonic() < end:
            try:
                reader, writer = await _open(args.host, args.port, args.source)
            except OSError:
                failed += 1
                await asyncio.sleep(0.2)
                continue
            opened += 1
            t0 = time.monotonic()
            writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
            held.add(writer)
            try:
                async with asyncio.timeout(max(0.0, end - t0)):
                    while await reader.read(4096):
                        pass  # closed by the node (after its 408, if any)
            except (OSError, TimeoutError):
                pass
            finally:
                held.discard(writer)
                lived.append(time.monotonic() - t0)
                writer.close()

    await asyncio.gather(trickle(), *(one(i) for i in range(args.count)))
    return {"opened": opened, "failed": failed, "closed": len(lived), "max_lived_s": max(lived, default=0.0)}


async def header(args: argparse.Namespace) -> dict[str, Any]:
    end = time.monotonic() + args.seconds
    sent_max = refused = 0
    chunk = b"a" * 16384
    while time.monotonic() < end:
        reader, writer = await _open(args.host, args.port, args.source)
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-endless: ")
        sent = 0
        try:
            while time.monotonic() < end and sent < 512 * 1024 * 1024:
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
                if reader.at_eof() or reader._buffer:  # type: ignore[attr-defined]
                    break
        except OSError:
            pass
        refused += 1
        sent_max = max(sent_max, sent)
        writer.close()
        await asyncio.sleep(args.pause)
    return {"connections": refused, "max_sent": sent_max}


async def bodies(args: argparse.Namespace) -> dict[str, Any]:
    size = 1024 * 1024
    statuses: dict[str, int] = {}
    written: list[int] = []

    async def one() -> None:
        reader, writer = await _open(args.host, args.port, args.source)
        writer.write(b"POST /v1/admin/tenants HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % size)
        sent, status = 0, "none"
        try:
            async with asyncio.timeout(args.seconds):
                while sent < size - 1 and not reader._buffer and not reader.at_eof():  # type: ignore[attr-defined]
                    n = min(65536, size - 1 - sent)
                    writer.write(b"{" * n)
                    await writer.drain()
                    sent += n
                    await asyncio.sleep(0.01)
                head = await reader.readuntil(b"\r\n\r\n")
                status = head.split(b" ", 2)[1].decode()
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            status = type(exc).__name__
        statuses[status] = statuses.get(status, 0) + 1
        written.append(sent)
        writer.close()

    await asyncio.gather(*(one() for _ in range(args.count)))
    return {"statuses": statuses, "max_written": max(written, default=0)}


async def bogus(args: argparse.Namespace) -> dict[str, Any]:
    end = time.monotonic() + args.seconds
    statuses: dict[str, int] = {}

    async def one() -> None:
        reader, writer = await _open(args.host, args.port, args.source)
        try:
            while time.monotonic() < end:
                key = "tw_" + secrets.token_urlsafe(32)
                writer.write(f"GET /v1/functions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n\r\n".encode())
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                status = head.split(b" ", 2)[1].decode()
                statuses[status] = statuses.get(status, 0) + 1
        except (OSError, asyncio.IncompleteReadError):
            statuses["closed"] = statuses.get("closed", 0) + 1
        finally:
            writer.close()

    await asyncio.gather(*(one() for _ in range(args.count)))
    return {"statuses": statuses}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["slow", "header", "bodies", "bogus"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--source", default="127.0.0.1", help="local address to connect from")
    ap.add_argument("--count", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--pause", type=float, default=0.0, help="between connections (header)")
    ap.add_argument("--ramp", type=float, default=0.0, help="seconds over which the first connections open (slow)")
    args = ap.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(json.dumps(asyncio.run(globals()[args.kind](args))), flush=True)


if __name__ == "__main__":
    main()
