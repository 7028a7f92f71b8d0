"""A `launch`'s argument records (docs/guest-abi.md, launch) and shape, checked before the backend
sees them. The checks run in a fixed order and their messages reach the guest through
`last_error`: both are part of the ABI.
"""

from __future__ import annotations

import struct
from typing import Any

from app.gpu.backend import DeviceLimits
from app.gpu.handles import AbiFailure, Buffer, Instance, get_handle
from app.gpu.signatures import MAX_ARG_RECORDS, Code, Tag
from app.kernels.std_numpy import NON_NEGATIVE, StdKernel

PAYLOAD = {Tag.I32: ("<i", 4, "i32"), Tag.I64: ("<q", 8, "i64"), Tag.F32: ("<f", 4, "f32"), Tag.F64: ("<d", 8, "f64")}
BUF_PAYLOAD = struct.Struct("<iq")
STD_TYPES = {"i32": Tag.I32, "f32": Tag.F32, "buf": Tag.BUFFER}


def parse_args(inst: Instance, raw: bytes) -> list[tuple[Tag, Any]]:
    """The records of `raw` as (tag, value); a buffer record's value is (Buffer, offset)."""
    out: list[tuple[Tag, Any]] = []
    pos = 0
    while pos < len(raw):
        if len(out) >= MAX_ARG_RECORDS:
            raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: more than {MAX_ARG_RECORDS} argument records")
        tag = raw[pos]
        pos += 1
        if tag == Tag.BUFFER:
            if pos + 12 > len(raw):
                raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: record {len(out)} (buffer) is truncated")
            handle, offset = BUF_PAYLOAD.unpack_from(raw, pos)
            pos += 12
            buf = get_handle(inst, "launch", handle, Buffer, "buffer")
            if offset < 0 or offset > buf.size:
                raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: record {len(out)}: offset {offset} is outside the buffer ({buf.size} bytes)")
            out.append((Tag.BUFFER, (buf, offset)))
        elif tag in PAYLOAD:
            fmt, size, _ = PAYLOAD[Tag(tag)]
            if pos + size > len(raw):
                raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: record {len(out)} is truncated")
            out.append((Tag(tag), struct.unpack_from(fmt, raw, pos)[0]))
            pos += size
        else:
            raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: record {len(out)} has unknown tag 0x{tag:02x}")
    return out


def check_dims(lim: DeviceLimits, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int) -> None:
    if min(grid) < 1 or min(block) < 1:
        raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: grid {grid} and block {block} must all be >= 1")
    if any(g > m for g, m in zip(grid, lim.max_grid, strict=True)):
        raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: grid {grid} exceeds the device maximum {lim.max_grid}")
    if any(b > m for b, m in zip(block, lim.max_block, strict=True)) or block[0] * block[1] * block[2] > lim.max_threads_per_block:
        raise AbiFailure(
            Code.INVALID_ARGUMENT,
            f"launch: block {block} exceeds the device maximum {lim.max_block} / {lim.max_threads_per_block} threads",
        )
    if shared < 0 or shared > lim.max_shared_bytes:
        raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: shared_bytes must be 0..{lim.max_shared_bytes}, got {shared}")


def check_std(name: str, spec: StdKernel, records: list[tuple[Tag, Any]]) -> list[Any]:
    """The values of a `std.<name>` launch, once their types, signs and buffer extents fit `spec`."""
    if len(records) != len(spec.params) or any(t != STD_TYPES[p] for (t, _), p in zip(records, spec.params, strict=True)):
        want = ", ".join(spec.params)
        got = ", ".join(Tag(t).name.lower() for t, _ in records)
        raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: std.{name} takes ({want}), got ({got})")
    values = [v for _, v in records]
    for i in NON_NEGATIVE[name]:
        if values[i] < 0:
            raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: std.{name} argument {i} must be >= 0, got {values[i]}")
    for i, need in spec.needs(values).items():
        buf, offset = values[i]
        if offset + need > buf.size:
            raise AbiFailure(
                Code.INVALID_ARGUMENT,
                f"launch: std.{name} argument {i} needs {need} bytes from offset {offset}, the buffer has {buf.size}",
            )
    return values


def buffer_handles(raw: bytes) -> list[int]:
    """Handles named by the 0x10 records of an already validated record stream."""
    out, pos = [], 0
    while pos < len(raw):
        tag = raw[pos]
        if tag == Tag.BUFFER:
            out.append(BUF_PAYLOAD.unpack_from(raw, pos + 1)[0])
            pos += 13
        else:
            pos += 1 + PAYLOAD[Tag(tag)][1]
    return out


def typed(tag: Tag, value: Any) -> Any:
    """A scalar record's value as the NumPy type of its width, for a user kernel's parameters."""
    import numpy as np

    return {Tag.I32: np.int32, Tag.I64: np.int64, Tag.F32: np.float32, Tag.F64: np.float64}[tag](value)
