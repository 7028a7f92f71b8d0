"""Build requests for examples/kernel_runner.c (the packer lives in app/gpu/kernel_runner.py)."""

from __future__ import annotations

import numpy as np

from app.gpu.kernel_runner import Buf, rec_buf, rec_f32, rec_f64, rec_i32, rec_i64, request

__all__ = ["Buf", "abi_code", "blocks", "f32", "rec_buf", "rec_f32", "rec_f64", "rec_i32", "rec_i64", "request"]


def f32(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=np.float32).tobytes()


def abi_code(exit_code: int) -> int:
    """kernel_runner exits with 64 - code on an ABI failure."""
    return 64 - exit_code


def blocks(n: int, block: int = 256) -> tuple[int, int, int]:
    return (max(1, -(-n // block)), 1, 1)
