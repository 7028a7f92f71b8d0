"""A front's worker connection (app/node/worker_conn.py) against a real unix socket whose far end
writes frames as the test cuts them: whole, a byte at a time, large bodies in pieces, chunks
before the result, a close mid-frame, a header that cannot be read."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from app.contract.frames import HEAD, MAX_HEADER, ProtocolError, encode
from app.contract.messages import Chunk, Done, Result, Run, RunStatus, WorkerMessage
from app.node.worker_conn import WorkerConnection
from app.observability.phases import WHOLE_BYTES

Far = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _run() -> Run:
    return Run(
        invocation_id="inv-1", function="f", sha256="0" * 64, env={}, timeout_ms=1000,
        wasm_memory_bytes=1 << 20, stdout_limit=1 << 20, stderr_limit=1024,
    )


def _frame(msg: WorkerMessage, body: bytes = b"") -> bytes:
    return b"".join(bytes(p) for p in encode(msg, body))


async def _read_run(reader: asyncio.StreamReader) -> bytes:
    """The run the connection sent: its body."""
    hlen, blen = HEAD.unpack(await reader.readexactly(HEAD.size))
    await reader.readexactly(hlen)
    return await reader.readexactly(blen)


@asynccontextmanager
async def _far(tmp_path: Path, far: Far) -> AsyncIterator[WorkerConnection]:
    path = str(tmp_path / "w.sock")
    server = await asyncio.start_unix_server(far, path)
    conn = await WorkerConnection.open(path)
    try:
        async with asyncio.timeout(10):
            yield conn
    finally:
        conn.close()
        server.close()


async def _write_in(writer: asyncio.StreamWriter, data: bytes, piece: int) -> None:
    for i in range(0, len(data), piece):
        writer.write(data[i : i + piece])
        await writer.drain()
        await asyncio.sleep(0)


@pytest.mark.parametrize("piece", [5, 4099, 1 << 20])  # 5 splits the 8-byte head
async def test_frames_cut_anywhere_read_whole_and_in_order(tmp_path: Path, piece: int) -> None:
    large = bytes(range(256)) * (WHOLE_BYTES // 256 * 3 + 1)  # over WHOLE_BYTES: read into its own buffer

    async def far(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            body = await _read_run(reader)
            out = _frame(Chunk(), b"c1") + _frame(Chunk(), large) + _frame(Result(status=RunStatus.OK, stdout_len=len(body)), body)
            await _write_in(writer, out, piece)

    chunks: list[bytes] = []
    async with _far(tmp_path, far) as conn:
        for body in (b"hello", large):
            msg, out = await conn.exchange(_run(), body, lambda c: chunks.append(bytes(c)))
            assert isinstance(msg, Result) and msg.stdout_len == len(body) and bytes(out) == body
        assert chunks == [b"c1", large] * 2
        assert not conn.at_eof()


async def test_chunks_without_a_listener_are_dropped_and_the_result_still_answers(tmp_path: Path) -> None:
    async def far(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_run(reader)
        writer.write(_frame(Chunk(), b"x" * 10) + _frame(Done()))

    async with _far(tmp_path, far) as conn:
        msg, out = await conn.exchange(_run(), b"", None)
        assert isinstance(msg, Done) and out == b""


async def test_a_worker_gone_mid_frame_or_before_answering_raises_eof(tmp_path: Path) -> None:
    async def mid_frame(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_run(reader)
        writer.write(_frame(Result(status=RunStatus.OK, stdout_len=4), b"abcd")[:-2])
        writer.close()

    async with _far(tmp_path, mid_frame) as conn:
        with pytest.raises(asyncio.IncompleteReadError):
            await conn.exchange(_run(), b"", None)
        assert conn.at_eof()
        with pytest.raises(EOFError):  # and every later use
            await conn.exchange(_run(), b"", None)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_run(reader)
        writer.close()

    async with _far(tmp_path, silent) as conn:
        with pytest.raises(EOFError):
            await conn.exchange(_run(), b"", None)


async def test_a_frame_that_cannot_be_read_is_a_protocol_error(tmp_path: Path) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_run(reader)
        writer.write(HEAD.pack(3, 0) + b"\xc1\xc1\xc1")  # not MessagePack

    async with _far(tmp_path, garbage) as conn:
        with pytest.raises(ProtocolError):
            await conn.exchange(_run(), b"", None)

    async def oversized(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_run(reader)
        writer.write(HEAD.pack(MAX_HEADER + 1, 0))

    async with _far(tmp_path, oversized) as conn:
        with pytest.raises(ProtocolError, match="too large"):
            await conn.exchange(_run(), b"", None)


async def test_a_run_larger_than_the_socket_buffer_waits_for_it_to_drain(tmp_path: Path) -> None:
    body = b"y" * (8 << 20)

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_frame(Chunk(), b"early"))  # a stream's first chunk, while the run is still coming
        await asyncio.sleep(0.2)  # the connection's writes pause meanwhile
        got = await _read_run(reader)
        writer.write(_frame(Result(status=RunStatus.OK, stdout_len=len(got))))

    chunks: list[bytes] = []
    async with _far(tmp_path, slow) as conn:
        msg, _ = await conn.exchange(_run(), body, lambda c: chunks.append(bytes(c)))
        assert isinstance(msg, Result) and msg.stdout_len == len(body)
        assert chunks == [b"early"]


async def test_after_a_half_close_the_next_frame_is_the_workers_answer(tmp_path: Path) -> None:
    async def stops(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_run(reader)
        assert await reader.read() == b""  # the front's half-close: the run is to stop
        writer.write(_frame(Chunk(), b"late") + _frame(Result(status=RunStatus.ERROR, stdout_len=0, error="stopped")))

    async with _far(tmp_path, stops) as conn:
        task = asyncio.create_task(conn.exchange(_run(), b"", None))
        await asyncio.sleep(0.1)
        task.cancel()  # the caller gave up (its deadline): the reply is read by whoever stops the run
        with pytest.raises(asyncio.CancelledError):
            await task
        conn.write_eof()
        msg, _ = await conn.next_frame()
        assert isinstance(msg, Result) and msg.error == "stopped"


def test_a_frame_is_written_without_empty_parts() -> None:
    # writelines with an empty part never drains from asyncio's socket transport on Python 3.12+
    for body, more in ((b"", ()), (b"", (b"tail",)), (b"body", (b"",)), (b"body", ())):
        parts = encode(_run(), body, *more)
        assert all(len(p) for p in parts)
        head, rest = bytes(parts[0]), b"".join(bytes(p) for p in parts[1:])
        hlen, blen = HEAD.unpack(head)
        assert (len(rest), rest[hlen:]) == (hlen + blen, body + b"".join(more))


def test_a_worker_whose_accept_queue_is_full_is_connected_to_once_it_accepts(tmp_path: Path) -> None:
    # uvloop (the fronts' loop) fails a unix connect at once with EAGAIN while the listener's
    # queue is full; a worker accepts only between runs, so that is a busy worker, not a lost one
    import socket

    import uvloop

    path = str(tmp_path / "w.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)  # one waits in the queue, the next is refused until an accept

    async def main() -> int:
        accepted: list[socket.socket] = []

        def accept_all() -> None:
            listener.setblocking(False)
            while True:
                try:
                    accepted.append(listener.accept()[0])
                except BlockingIOError:
                    return

        loop = asyncio.get_running_loop()
        loop.call_later(0.1, lambda: loop.add_reader(listener.fileno(), accept_all))  # the run ends
        conns = await asyncio.wait_for(asyncio.gather(*(WorkerConnection.open(path) for _ in range(4))), 5)
        loop.remove_reader(listener.fileno())
        for c in conns:
            c.close()
        for a in accepted:
            a.close()
        return len(conns)

    try:
        assert uvloop.run(main()) == 4
    finally:
        listener.close()
