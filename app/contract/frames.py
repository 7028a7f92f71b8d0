"""Frames that carry worker messages over pipes and unix sockets.

A frame is ``u32 header_len | u32 body_len | header (MessagePack, app/contract/messages.py) |
body (raw bytes)``. Several frames may answer one request (a run's chunks, then its result).
"""

from __future__ import annotations

import asyncio
import struct
from typing import BinaryIO, Protocol

import msgspec

from app.contract.messages import WorkerMessage, worker_decoder, worker_encoder
from app.observability.phases import REPLY, WHOLE_BYTES, clock, lap

HEAD = struct.Struct("<II")
MAX_HEADER = 16 * 1024 * 1024
MAX_BODY = 1 << 31
_SMALL_BODY = 256 * 1024  # read whole; a larger body goes straight into a buffer of its size

Buffer = bytes | bytearray | memoryview
Payload = bytes | bytearray  # a frame's body as read: a large one in a buffer of its own


class ProtocolError(RuntimeError):
    pass


class FrameSink(Protocol):
    """Where `write_frame` writes: a binary file, or anything that takes parts and a flush."""

    def write(self, data: Buffer, /) -> object: ...

    def flush(self) -> None: ...


def encode(header: WorkerMessage, body: Buffer = b"", *more: Buffer) -> list[Buffer]:
    """`more`: further parts of the body, sent after it as they are (never joined to it)."""
    raw = worker_encoder.encode(header)
    parts = [HEAD.pack(len(raw), len(body) + sum(len(m) for m in more)), raw, body, *more]
    # no empty part: one never drains from asyncio's socket transport on Python 3.12+ (its
    # `writelines`, CPython gh-155888), and the loop spins on it
    return parts if body and not more else [p for p in parts if len(p)]


def check_sizes(hlen: int, blen: int) -> None:
    if hlen > MAX_HEADER or blen > MAX_BODY:
        raise ProtocolError(f"frame too large: header {hlen}, body {blen}")


def decode_header(raw: bytes | memoryview) -> WorkerMessage:
    try:
        return worker_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad frame header: {exc}") from None


def write_frame(stream: FrameSink, header: WorkerMessage, body: Buffer = b"", *more: Buffer) -> None:
    for part in encode(header, body, *more):
        stream.write(part)
    stream.flush()


def read_frame(stream: BinaryIO) -> tuple[WorkerMessage, bytes] | None:
    """The next frame, or None at a clean end of stream."""
    head = stream.read(HEAD.size)
    if not head:
        return None
    if len(head) < HEAD.size:
        raise ProtocolError("truncated frame")
    hlen, blen = HEAD.unpack(head)
    check_sizes(hlen, blen)
    raw = stream.read(hlen)
    if len(raw) != hlen:
        raise ProtocolError("truncated header")
    body = stream.read(blen) if blen else b""
    if len(body) != blen:
        raise ProtocolError("truncated body")
    return decode_header(raw), body


async def read_frame_async(reader: asyncio.StreamReader) -> tuple[WorkerMessage, Payload]:
    """Raises asyncio.IncompleteReadError when the peer closes. The frame's reading, once its
    first bytes are in, is a front's REPLY phase (a body over WHOLE_BYTES may wait for the rest)."""
    hlen, blen = HEAD.unpack(await reader.readexactly(HEAD.size))  # the wait for the peer
    t = clock()
    check_sizes(hlen, blen)
    header = decode_header(await reader.readexactly(hlen))
    if blen <= WHOLE_BYTES:
        whole = await reader.readexactly(blen) if blen else b""
        lap(REPLY, t)
        return header, whole
    lap(REPLY, t)
    if blen <= _SMALL_BODY:
        return header, await reader.readexactly(blen)
    # A large body (a guest's output, up to the cap) is read piece by piece into its own buffer:
    # readexactly would hold all of it in the stream's buffer and then copy it out whole. A piece
    # is at most _SMALL_BODY: `read` copies it out of the stream's buffer, which holds up to twice
    # the stream's limit when the peer writes faster than this reads.
    body = bytearray(blen)
    view, got = memoryview(body), 0
    while got < blen:
        piece = await reader.read(min(blen - got, _SMALL_BODY))
        if not piece:
            raise asyncio.IncompleteReadError(bytes(view[:got]), blen)
        view[got : got + len(piece)] = piece
        got += len(piece)
    return header, body
