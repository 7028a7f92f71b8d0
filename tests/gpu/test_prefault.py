from __future__ import annotations

import ctypes
import mmap

from app.gpu.prefault import prefault


def test_prefault_keeps_contents_and_accepts_any_range() -> None:
    size = 4 << 20
    m = mmap.mmap(-1, size)
    buf = (ctypes.c_char * size).from_buffer(m)
    m[:5] = b"hello"
    addr = ctypes.addressof(buf)
    prefault(addr + 3, size - 3)  # unaligned start, runs to the end
    prefault(addr, 100)  # small: skipped
    assert m[:5] == b"hello" and m[size - 1 : size] == b"\0"
    del buf
    m.close()
