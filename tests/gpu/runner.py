"""Build requests for tests/guests/kernel_runner.c."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np


def rec_buf(index: int, offset: int = 0) -> bytes:
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
    init: bytes = b""


def request(
    fn: str,
    bufs: list[Buf],
    records: list[bytes],
    outs: list[int],
    grid: tuple[int, int, int] = (1, 1, 1),
    block: tuple[int, int, int] = (256, 1, 1),
    module: str | bytes = "std",
    kind: int = 0,
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


def f32(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=np.float32).tobytes()


def abi_code(exit_code: int) -> int:
    """kernel_runner exits with 64 - code on an ABI failure."""
    return 64 - exit_code


def blocks(n: int, block: int = 256) -> tuple[int, int, int]:
    return (max(1, -(-n // block)), 1, 1)
