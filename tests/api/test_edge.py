"""A front's connections under limits (app/api/edge.py), against a real uvicorn server in this
loop with small limits: slow and oversized heads, slow bodies, a full front, early answers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn

from app.api.edge import RESPOND_NOW, EdgeEvent, EdgeLimits, _HeadWithBody, edge_protocol

LIMITS = EdgeLimits(max_connections=20, head_timeout_s=0.5, max_head_bytes=4096, max_headers=10, body_grace_s=0.5, min_body_rate=1000)


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Echoes the body; `/early` answers without reading it; `/hold` waits before answering;
    `/now...` answers through RESPOND_NOW where it can."""
    if scope["type"] != "http":
        return
    body = b""
    if scope["path"] == "/hold":
        await asyncio.sleep(1.5)
    elif scope["path"] != "/early":
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
    if scope["path"].startswith("/now") and scope[RESPOND_NOW](200, [(b"x-way", b"now")], body):
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def _server(
    limits: EdgeLimits = LIMITS, events: list[EdgeEvent] | None = None, keep_alive_s: float = 5,
) -> AsyncIterator[tuple[int, uvicorn.Server]]:
    protocol = edge_protocol(limits, events.append if events is not None else None)
    config = uvicorn.Config(
        _echo, host="127.0.0.1", port=0, http=protocol, lifespan="off", log_config=None, access_log=False,
        timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]  # typed int, used as any number of seconds
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server._serve())  # serve() would take over the signals
    async with asyncio.timeout(10):
        while not server.started:
            await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield port, server
    finally:
        server.should_exit = True
        await task


async def _exchange(port: int, raw: bytes, bound_s: float = 5) -> tuple[float, bytes]:
    """Send `raw`, read until the server closes; (seconds it took, what came back)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    writer.write(raw)
    async with asyncio.timeout(bound_s):
        data = await reader.read()
    writer.close()
    return time.monotonic() - t0, data


def _status(data: bytes) -> int:
    return int(data.split(b" ", 2)[1])


async def test_a_request_within_the_limits_is_served_and_keeps_its_connection() -> None:
    async with _server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for i in range(3):
            writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nh%d" % i)
            head = await reader.readuntil(b"\r\n\r\n")
            assert _status(head) == 200 and await reader.readexactly(2) == b"h%d" % i
            await asyncio.sleep(0.3)  # idle between requests, less than the head time each time
        writer.close()


async def test_an_idle_keep_alive_is_closed_quietly_at_its_time_and_a_started_head_gets_the_head_time() -> None:
    limits = EdgeLimits(max_connections=20, head_timeout_s=1.0, max_head_bytes=4096, max_headers=10, body_grace_s=0.5, min_body_rate=1000)
    events: list[EdgeEvent] = []
    async with _server(limits, events, keep_alive_s=0.3) as (port, server):
        # answered, then nothing: closed without a word after the keep-alive time, not the head's
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi")
        head = await reader.readuntil(b"\r\n\r\n")
        assert _status(head) == 200 and await reader.readexactly(2) == b"hi"
        t0 = time.monotonic()
        async with asyncio.timeout(5):
            assert await reader.read() == b""
        assert 0.25 <= time.monotonic() - t0 < 0.9
        writer.close()
        # answered, then part of a next head: that head has the head's time, and gets its 408
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi")
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        t0 = time.monotonic()
        writer.write(b"GET / HTTP/1.1\r\n")
        async with asyncio.timeout(5):
            data = await reader.read()
        assert _status(data) == 408 and 0.9 <= time.monotonic() - t0 < 2.5
        writer.close()
        # a connection that never sent a byte is no keep-alive: it has the head's time too
        took, data = await _exchange(port, b"")
        assert _status(data) == 408 and 0.9 <= took < 2.5
        assert not server.server_state.connections
    assert events == [EdgeEvent.HEAD_TIMEOUT] * 2


async def test_many_waiting_connections_each_get_their_own_time() -> None:
    # connections that began to wait at different times are refused each at its own time
    async with _server() as (port, _):
        first = asyncio.create_task(_exchange(port, b"GET / HTTP/1.1\r\n"))
        await asyncio.sleep(0.3)
        second = asyncio.create_task(_exchange(port, b"GET / HTTP/1.1\r\n"))
        (took1, data1), (took2, data2) = await asyncio.gather(first, second)
        assert _status(data1) == _status(data2) == 408
        assert 0.4 <= took1 < 1.2 and 0.4 <= took2 < 1.2


async def test_a_head_that_does_not_arrive_in_time_is_refused() -> None:
    events: list[EdgeEvent] = []
    async with _server(events=events) as (port, server):
        took, data = await _exchange(port, b"GET / HTTP/1.1\r\nhost: x\r\n")  # never ends
        assert _status(data) == 408 and b"request_timeout" in data
        assert 0.4 <= took < 3
        took, data = await _exchange(port, b"")  # a connection that sends nothing
        assert _status(data) == 408
        assert not server.server_state.connections
    assert events == [EdgeEvent.HEAD_TIMEOUT] * 2


async def test_a_head_too_large_is_refused_without_reading_it_all() -> None:
    async with _server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nx-endless: ")
        sent, data = 0, b""
        async with asyncio.timeout(5):
            try:
                while sent < 10 * 1024 * 1024:  # an endless header value
                    writer.write(b"a" * 1024)
                    await writer.drain()
                    sent += 1024
                    if reader._buffer or reader.at_eof():  # type: ignore[attr-defined]  # the refusal came
                        break
                    await asyncio.sleep(0)
                data = await reader.read()
            except ConnectionError:
                pass  # closed with our bytes unread: the kernel may reset rather than deliver the 431
        assert not data or (_status(data) == 431 and b"headers_too_large" in data)
        assert sent < 1024 * 1024  # refused as it passed the bound, not at the end of the header
        took, data = await _exchange(port, b"GET / HTTP/1.1\r\n" + b"".join(b"h%d: v\r\n" % i for i in range(11)) + b"\r\n")
        assert _status(data) == 431 and b"header fields" in data


async def test_a_body_slower_than_the_minimum_rate_is_refused() -> None:
    events: list[EdgeEvent] = []
    async with _server(events=events) as (port, _):
        took, data = await _exchange(port, b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\nab")
        assert _status(data) == 408 and b"slower than 1000 bytes" in data
        assert took < 4
    assert events == [EdgeEvent.BODY_TOO_SLOW]


async def test_an_answer_before_the_body_closes_the_connection() -> None:
    async with _server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /early HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\nab")
        async with asyncio.timeout(5):
            data = await reader.read()  # the server closed: the rest of the body is never read
        assert _status(data) == 200
        writer.close()


async def test_a_full_front_closes_the_longest_waiting_connection_first() -> None:
    events: list[EdgeEvent] = []
    async with _server(events=events) as (port, server):
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(LIMITS.max_connections)]
        took, data = await _exchange(port, b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert _status(data) == 200
        async with asyncio.timeout(5):
            assert await idle[0][0].read() == b""  # the oldest idle one made room
        assert len(server.server_state.connections) <= LIMITS.max_connections
        for _, writer in idle:
            writer.close()
    assert events == [EdgeEvent.MADE_ROOM]


async def test_a_front_whose_connections_are_all_in_requests_refuses_the_next() -> None:
    events: list[EdgeEvent] = []
    async with _server(events=events) as (port, server):
        busy = []
        for _ in range(LIMITS.max_connections):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
            busy.append((reader, writer))
        async with asyncio.timeout(5):
            while len(server.server_state.tasks) < LIMITS.max_connections:
                await asyncio.sleep(0.01)
        took, data = await _exchange(port, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert _status(data) == 503 and b"too_many_connections" in data and b"retry-after: 1" in data
        for reader, writer in busy:  # each held request is still answered
            async with asyncio.timeout(5):
                assert _status(await reader.readuntil(b"\r\n\r\n")) == 200
            writer.close()
    assert events == [EdgeEvent.CONNECTIONS_FULL]


async def test_pipelined_requests_are_each_answered() -> None:
    async with _server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # the second request's body comes after the first is answered
        writer.write(b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhiPOST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n12345")
        async with asyncio.timeout(5):
            assert _status(await reader.readuntil(b"\r\n\r\n")) == 200 and await reader.readexactly(2) == b"hi"
            await asyncio.sleep(0.1)
            writer.write(b"67890")
            assert _status(await reader.readuntil(b"\r\n\r\n")) == 200 and await reader.readexactly(10) == b"1234567890"
        writer.close()


async def test_a_body_read_with_the_next_head_counts_nothing_against_that_head() -> None:
    async with _server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b"x" * (LIMITS.max_head_bytes * 2)  # one read: this body, then the next head's start
        writer.write(b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%sGET /b HTTP/1.1\r\nhost: x\r\n" % (len(body), body))
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
            assert _status(head) == 200
            await reader.readexactly(len(body))
            writer.write(b"\r\n")
            assert _status(await reader.readuntil(b"\r\n\r\n")) == 200
        writer.close()


class _Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, list[bytes]]] = []

    def write(self, data: bytes) -> None:
        self.sent.append(("write", [data]))

    def writelines(self, data: Any) -> None:
        self.sent.append(("writelines", list(data)))

    def close(self) -> None:
        self.sent.append(("close", []))

    def is_closing(self) -> bool:
        return False


def test_a_head_with_a_length_leaves_with_the_body_and_nothing_else_waits() -> None:
    t = _Recorder()
    w = _HeadWithBody(t)  # type: ignore[arg-type]
    head = b"HTTP/1.1 200 OK\r\nserver: x\r\ncontent-length: 5\r\n\r\n"
    w.write(head)
    assert t.sent == []  # held for the body
    w.write(b"hello")
    assert t.sent == [("writelines", [head, b"hello"])]
    t.sent.clear()
    w.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # the client waits for it before its body
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"  # a stream's head goes at once
    w.write(chunked)
    assert t.sent == [("write", [b"HTTP/1.1 100 Continue\r\n\r\n"]), ("write", [chunked])]
    t.sent.clear()
    w.write(head)
    w.close()  # an answer cut short: its head still goes, then the close
    assert t.sent == [("write", [head]), ("close", [])]
    assert not w.is_closing()  # the rest is the transport's own


def test_a_held_head_before_an_empty_body_leaves_alone() -> None:
    # writelines with an empty part never drains from asyncio's socket transport on Python 3.12+
    t = _Recorder()
    w = _HeadWithBody(t)  # type: ignore[arg-type]
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
    w.write(head)
    w.write(b"")
    assert t.sent == [("write", [head])]


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One answer with a length: (head, body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    return head, await reader.readexactly(length)


async def test_an_answer_written_at_once_is_whole_and_keeps_the_connection() -> None:
    async with _server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        async with asyncio.timeout(5):
            for i in range(3):
                writer.write(b"POST /now HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nh%d" % i)
                head, body = await _answer(reader)
                lines = head.split(b"\r\n")
                assert lines[0] == b"HTTP/1.1 200 OK" and body == b"h%d" % i
                assert b"x-way: now" in lines and b"content-length: 2" in lines and b"server: uvicorn" in lines
                assert any(line.startswith(b"date: ") for line in lines) and b"connection: close" not in lines
            # pipelined: both answered, in order, each written at once
            writer.write(b"POST /now/a HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\naPOST /now/b HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\nb")
            assert [await _answer(reader) for _ in range(2)][1][1] == b"b"
        writer.close()


async def test_an_answer_written_at_once_closes_where_uvicorn_would() -> None:
    async with _server() as (port, _):
        # HTTP/1.0 keeps no connection: the answer says so and the server closes
        _, data = await _exchange(port, b"POST /now HTTP/1.0\r\ncontent-length: 2\r\n\r\nhi")
        assert _status(data) == 200 and b"x-way: now" in data and b"connection: close" in data and data.endswith(b"\r\n\r\nhi")
        # HEAD has no body to write: the answer goes through ASGI send
        _, data = await _exchange(port, b"HEAD /now HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert _status(data) == 200 and b"x-way" not in data and data.endswith(b"\r\n\r\n")


def test_a_protocol_class_served_on_a_second_loop_sweeps_there() -> None:
    # the sweep belongs to the loop its server runs on: a class whose first server ran on
    # another loop (now closed) still times its heads out on this one
    protocol = edge_protocol(LIMITS)

    async def serve_once() -> tuple[int, float]:
        config = uvicorn.Config(_echo, host="127.0.0.1", port=0, http=protocol, lifespan="off", log_config=None, access_log=False)
        server = uvicorn.Server(config)
        task = asyncio.create_task(server._serve())
        async with asyncio.timeout(10):
            while not server.started:
                await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            took, data = await _exchange(port, b"GET / HTTP/1.1\r\n")
            return _status(data), took
        finally:
            server.should_exit = True
            await task

    for _ in range(2):
        status, took = asyncio.run(serve_once())
        assert status == 408 and 0.4 <= took < 2
