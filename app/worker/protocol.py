"""The api <-> worker wire format over the worker's stdin/stdout pipes.

A frame is ``u32 header_len | u32 body_len | header (JSON object) | body (raw bytes)``.
JSON headers and raw bodies keep the protocol explicit and safe: neither side unpickles
anything the other wrote, so a compromised worker cannot run code in the api process.

Requests (api -> worker), by ``op``:
  ``bind``    {tenant_id, tenant, gpu_memory_bytes}            -> ``ok``
  ``run``     {invocation_id, function, sha256, artifact, env, argv, timeout_ms,
               wasm_memory_bytes, stdout_limit, stderr_limit, kernels?, traceparent?}; body = stdin
              -> ``result`` {status, exit_code, error, stdout_len, duration_ms, host: {launches,
               compile_hits, compile_misses, gpu_peak_bytes, device_error?}, spans?};
               body = stdout + stderr tail; with ``stream: true`` the stdout is not in the
               result: each guest write is sent first as its own ``chunk`` frame (body = the bytes)
  ``stats``   {}                                               -> ``stats`` {gpu_bytes_in_use, ...}
  ``exit``    {}                                               -> (the worker exits)
Unsolicited (worker -> api): ``ready`` {pid, backend, device} once at start.
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any, BinaryIO

_HEAD = struct.Struct("<II")
MAX_HEADER = 16 * 1024 * 1024
MAX_BODY = 1 << 31


class ProtocolError(RuntimeError):
    pass


def encode(header: dict[str, Any], body: bytes | bytearray | memoryview = b"") -> list[bytes | bytearray | memoryview]:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return [_HEAD.pack(len(raw), len(body)), raw, body]


def write_frame(stream: BinaryIO, header: dict[str, Any], body: bytes | bytearray | memoryview = b"") -> None:
    for part in encode(header, body):
        stream.write(part)
    stream.flush()


def _check(hlen: int, blen: int) -> None:
    if hlen > MAX_HEADER or blen > MAX_BODY:
        raise ProtocolError(f"frame too large: header {hlen}, body {blen}")


def read_frame(stream: BinaryIO) -> tuple[dict[str, Any], bytes] | None:
    head = stream.read(_HEAD.size)
    if not head:
        return None
    if len(head) < _HEAD.size:
        raise ProtocolError("truncated frame")
    hlen, blen = _HEAD.unpack(head)
    _check(hlen, blen)
    header = json.loads(stream.read(hlen))
    body = stream.read(blen) if blen else b""
    if len(body) != blen:
        raise ProtocolError("truncated body")
    return header, body


async def read_frame_async(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    """Raises asyncio.IncompleteReadError when the worker's pipe closes."""
    hlen, blen = _HEAD.unpack(await reader.readexactly(_HEAD.size))
    _check(hlen, blen)
    rest = await reader.readexactly(hlen + blen)
    return json.loads(rest[:hlen]), rest[hlen:]
