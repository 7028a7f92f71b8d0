"""Requests for the kernel-runner guest (examples/kernel_runner.c): one kernel, its buffers and
argument records, packed the way the guest reads its stdin. Used by the GPU benchmark and tests."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

# The guest is an example, not package data: the GPU benchmark builds it from a checkout (or
# takes a prebuilt one from TENSORWASM_PREBUILT_GUESTS).
SOURCE = Path(__file__).resolve().parents[2] / "examples" / "kernel_runner.c"

# flags: prefix stdout with u64 ns of the launches + synchronize (1) / of the whole path (2) /
# of each of the path's steps (4), in that order
TIME_LAUNCHES = 1
TIME_PATH = 2
TIME_STEPS = 4
PATH_STEPS = ("alloc", "write", "module and function", "launch and sync", "output malloc", "read")


def rec_buf(index: int, offset: int = 0) -> bytes:
    """A 0x10 record; the guest swaps the buffer index for that buffer's handle."""
    return struct.pack("<Biq", 0x10, index, offset)


def rec_i32(v: int) -> bytes:
    return struct.pack("<Bi", 0x01, v)


def rec_i64(v: int) -> bytes:
    return struct.pack("<Bq", 0x02, v)


def rec_f32(v: float) -> bytes:
    return struct.pack("<Bf", 0x03, v)


def rec_f64(v: float) -> bytes:
    return struct.pack("<Bd", 0x04, v)


@dataclass
class Buf:
    size: int
    init: bytes = b""  # repeated by the guest to fill the buffer


def request(
    fn: str,
    bufs: list[Buf],
    records: list[bytes],
    outs: list[int],
    grid: tuple[int, int, int] = (1, 1, 1),
    block: tuple[int, int, int] = (256, 1, 1),
    module: str | bytes = "std",
    kind: int = 0,  # 0: module_get(module), 1: module_load CUDA C, 2: module_load PTX
    shared: int = 0,
    repeat: int = 1,
    flags: int = 0,
) -> bytes:
    m = module.encode() if isinstance(module, str) else module
    out = [struct.pack("<BI", kind, len(m)), m, struct.pack("<I", len(fn)), fn.encode(), struct.pack("<I", len(bufs))]
    for b in bufs:
        out += [struct.pack("<QI", b.size, len(b.init)), b.init]
    args = b"".join(records)
    out += [struct.pack("<7I", *grid, *block, shared), struct.pack("<I", len(args)), args]
    out += [struct.pack("<III", repeat, flags, len(outs)), struct.pack(f"<{len(outs)}I", *outs)]
    return b"".join(out)
