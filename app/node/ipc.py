"""Node messages (app/contract/messages.py) over the supervisor's unix socket: each is
``u32 length | MessagePack``."""

from __future__ import annotations

import asyncio
import struct

import msgspec

from app.contract.frames import ProtocolError
from app.contract.messages import NodeMessage, node_decoder, node_encoder

_LEN = struct.Struct("<I")
MAX_MESSAGE = 64 * 1024 * 1024  # a view of many workers, or the supervisor's metrics text


def pack(msg: NodeMessage) -> bytes:
    raw = node_encoder.encode(msg)
    return _LEN.pack(len(raw)) + raw


async def read_message(reader: asyncio.StreamReader) -> NodeMessage:
    """Raises asyncio.IncompleteReadError when the peer closes, ProtocolError on garbage."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_MESSAGE:
        raise ProtocolError(f"node message too large: {n} bytes")
    try:
        return node_decoder.decode(await reader.readexactly(n))
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad node message: {exc}") from None
