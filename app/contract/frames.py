"""Frames that carry worker messages over pipes and unix sockets.

A frame is ``u32 header_len | u32 body_len | header (MessagePack, app/contract/messages.py) |
body (raw bytes)``. Several frames may answer one request (a run's chunks, then its result).
"""

from __future__ import annotations

import asyncio
import struct
from typing import BinaryIO

import msgspec

from app.contract.messages import WorkerMessage, worker_decoder, worker_encoder

_HEAD = struct.Struct("<II")
MAX_HEADER = 16 * 1024 * 1024
MAX_BODY = 1 << 31

Buffer = bytes | bytearray | memoryview


class ProtocolError(RuntimeError):
    pass


def encode(header: WorkerMessage, body: Buffer = b"") -> list[Buffer]:
    raw = worker_encoder.encode(header)
    return [_HEAD.pack(len(raw), len(body)), raw, body]


def _check(hlen: int, blen: int) -> None:
    if hlen > MAX_HEADER or blen > MAX_BODY:
        raise ProtocolError(f"frame too large: header {hlen}, body {blen}")


def _decode(raw: bytes | memoryview) -> WorkerMessage:
    try:
        return worker_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad frame header: {exc}") from None


def write_frame(stream: BinaryIO, header: WorkerMessage, body: Buffer = b"") -> None:
    for part in encode(header, body):
        stream.write(part)
    stream.flush()


def read_frame(stream: BinaryIO) -> tuple[WorkerMessage, bytes] | None:
    """The next frame, or None at a clean end of stream."""
    head = stream.read(_HEAD.size)
    if not head:
        return None
    if len(head) < _HEAD.size:
        raise ProtocolError("truncated frame")
    hlen, blen = _HEAD.unpack(head)
    _check(hlen, blen)
    raw = stream.read(hlen)
    if len(raw) != hlen:
        raise ProtocolError("truncated header")
    body = stream.read(blen) if blen else b""
    if len(body) != blen:
        raise ProtocolError("truncated body")
    return _decode(raw), body


async def read_frame_async(reader: asyncio.StreamReader) -> tuple[WorkerMessage, bytes]:
    """Raises asyncio.IncompleteReadError when the peer closes."""
    hlen, blen = _HEAD.unpack(await reader.readexactly(_HEAD.size))
    _check(hlen, blen)
    rest = await reader.readexactly(hlen + blen)
    return _decode(memoryview(rest)[:hlen]), rest[hlen:]
