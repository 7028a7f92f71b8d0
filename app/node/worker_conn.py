"""A front's connection to one worker's unix socket: runs out, frames (app/contract/frames.py) back.

A protocol of its own rather than asyncio's streams: a reply is parsed where its bytes arrive
(`data_received`) and handed to the waiting call in one step, where a StreamReader took three
`readexactly` awaits per frame, each with its own checks and, when the bytes were not in yet, a
future of its own. A body over WHOLE_BYTES goes straight into a buffer of its size (one copy,
as `read_frame_async` reads it). Chunks of a streamed run go to the call's `on_chunk` as they
arrive; the run's last frame answers `exchange`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from app.contract.frames import HEAD, Buffer, Payload, ProtocolError, check_sizes, decode_header, encode
from app.contract.messages import Chunk, Run, WorkerMessage
from app.node.spin import AWAKE
from app.observability.phases import REPLY, SEND, WHOLE_BYTES, clock, lap

Frame = tuple[WorkerMessage, Payload]

_BUSY_FIRST_S = 0.001  # a full accept queue: the first pause before connecting again, doubled up to
_BUSY_LONGEST_S = 0.05


class WorkerConnection(asyncio.Protocol):
    """One connection; one exchange at a time. Raises what a stream would: EOFError
    (asyncio.IncompleteReadError) when the worker closes mid-frame or before answering, OSError
    when the connection fails, ProtocolError for a frame that cannot be read."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._frames: list[Frame] = []  # complete frames no one has taken yet
        self._head: WorkerMessage | None = None  # a large frame's header
        self._body: bytearray | None = None  # ... and its body as far as it came
        self._got = 0
        self._waiter: asyncio.Future[None] | None = None
        self._on_chunk: Callable[[Payload], None] | None = None
        self._error: BaseException | None = None  # the connection's end, raised to every later read
        self._paused = False
        self._drained: asyncio.Future[None] | None = None

    @classmethod
    async def open(cls, path: str) -> WorkerConnection:
        """Connect; a worker whose accept queue is full is busy, not gone: tried again shortly.
        A worker accepts between runs, so calls queued behind a long run can fill the queue,
        and uvloop's connect then fails at once with EAGAIN (asyncio's own loop waits); the
        caller's own deadline (its queue wait) bounds the retries."""
        loop = asyncio.get_running_loop()
        pause = _BUSY_FIRST_S
        while True:
            try:
                transport, protocol = await loop.create_unix_connection(cls, path)
            except BlockingIOError:
                await asyncio.sleep(pause)
                pause = min(2 * pause, _BUSY_LONGEST_S)
                continue
            protocol._transport = transport  # uvloop may call connection_made after this returns
            return protocol

    # -- the caller's side -----------------------------------------------------------------------
    async def exchange(self, run: Run, body: Buffer, on_chunk: Callable[[Payload], None] | None) -> Frame:
        """Send the run; the worker's last frame and its body (Chunk frames go to `on_chunk`)."""
        t = clock()
        transport = self._live()
        self._on_chunk = on_chunk  # before the write: a stream's first chunk may come while it drains
        try:
            transport.writelines(encode(run, body))
            AWAKE.poke()  # the reply read as it lands rather than after a wake-up
            lap(SEND, t)
            if self._paused:
                await self._drain()
            return await self.next_frame()
        finally:
            self._on_chunk = None

    async def next_frame(self) -> Frame:
        """The next frame that is not a Chunk (chunks go to the exchange's `on_chunk`, if any)."""
        while not self._frames:
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._frames.pop(0)

    def write_eof(self) -> None:
        self._live().write_eof()

    def at_eof(self) -> bool:
        return self._error is not None or self._transport is None or self._transport.is_closing()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _live(self) -> asyncio.Transport:
        if self._error is not None:
            raise self._error
        assert self._transport is not None
        return self._transport

    async def _drain(self) -> None:
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._drained)

    # -- the event loop's side -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # a unix socket's: a Transport

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._release_drain()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._error is None:
            partial = bytes(self._buf) if self._body is None else bytes(memoryview(self._body)[: self._got])
            self._error = exc if exc is not None else asyncio.IncompleteReadError(partial, None)
        self._release_drain()
        self._wake()

    def data_received(self, data: bytes) -> None:
        if self._error is not None:
            return
        try:
            self._take(data)
        except ProtocolError as exc:
            self._error = exc
            if self._transport is not None:
                self._transport.close()
        self._wake()

    def eof_received(self) -> bool | None:
        return None  # close: a worker that half-closes is done with this connection

    def _take(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._body is not None:  # a large body arriving: straight into its buffer
                view = self._fill(view)
            else:
                self._buf += view
                view = self._parse()

    def _fill(self, view: memoryview) -> memoryview:
        """A large body's next bytes from `view`; returns what comes after the body."""
        body = self._body
        assert body is not None and self._head is not None
        n = min(len(view), len(body) - self._got)
        body[self._got : self._got + n] = view[:n]
        self._got += n
        if self._got == len(body):
            header = self._head
            self._head, self._body, self._got = None, None, 0
            self._frame(header, body)
        return view[n:]

    def _parse(self) -> memoryview:
        """Complete frames out of the buffer. At a large frame's header its body gets a buffer of
        its own, and what the buffer held of it is returned, to fill that buffer."""
        buf = self._buf
        while len(buf) >= HEAD.size:
            hlen, blen = HEAD.unpack_from(buf)
            check_sizes(hlen, blen)
            start = HEAD.size + hlen
            end = start + blen
            whole = blen <= WHOLE_BYTES
            if len(buf) < (end if whole else start):
                break
            t = clock()
            header = decode_header(bytes(buf[HEAD.size : start]))
            if not whole:
                lap(REPLY, t)
                self._head, self._body, self._got = header, bytearray(blen), 0
                rest = bytes(buf[start:])
                del buf[:]
                return memoryview(rest)
            body = bytes(buf[start:end])
            del buf[:end]
            lap(REPLY, t)
            self._frame(header, body)
        return memoryview(b"")

    def _frame(self, header: WorkerMessage, body: Payload) -> None:
        if isinstance(header, Chunk):
            if self._on_chunk is not None:
                self._on_chunk(body)
            return
        self._frames.append((header, body))

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done() and (self._frames or self._error is not None):
            waiter.set_result(None)

    def _release_drain(self) -> None:
        """Wake a wait for the buffer to drain; a connection lost meanwhile raises at the read."""
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)
