"""The `std` library's parameter lists, the bytes each buffer argument must hold, and a NumPy
twin of every kernel (the CPU backend runs these; GPU tests compare the CUDA kernels to them).

A buffer argument arrives as a uint8 NumPy view that starts at the record's offset and ends at
the buffer's end; the twins view it as float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

F32 = 4


@dataclass(frozen=True)
class StdKernel:
    params: tuple[str, ...]  # "buf", "i32", "f32"
    # bytes each buffer parameter must hold (by parameter index), from the scalar arguments
    needs: Callable[[list[Any]], dict[int, int]]
    run: Callable[[list[Any]], None]


def _f32(view: np.ndarray, count: int) -> np.ndarray:
    return view[: count * F32].view(np.float32)


def _vector_add(a: list[Any]) -> None:
    n = a[3]
    np.add(_f32(a[0], n), _f32(a[1], n), out=_f32(a[2], n))


def _saxpy(a: list[Any]) -> None:
    alpha, n = np.float32(a[0]), a[3]
    y = _f32(a[2], n)
    y[:] = alpha * _f32(a[1], n) + y


def _scale(a: list[Any]) -> None:
    n = a[2]
    x = _f32(a[0], n)
    x *= np.float32(a[1])


def _relu(a: list[Any]) -> None:
    n = a[2]
    np.maximum(_f32(a[0], n), np.float32(0), out=_f32(a[1], n))


def _sum(a: list[Any]) -> None:
    n = a[2]
    out = _f32(a[1], 1)
    out[0] = np.float32(out[0] + _f32(a[0], n).sum(dtype=np.float32))


def _gemm(a: list[Any]) -> None:
    m, n, k = a[3], a[4], a[5]
    A = _f32(a[0], m * k).reshape(m, k)
    B = _f32(a[1], k * n).reshape(k, n)
    np.matmul(A, B, out=_f32(a[2], m * n).reshape(m, n))


def _softmax(a: list[Any]) -> None:
    rows, cols = a[2], a[3]
    if rows == 0 or cols == 0:
        return
    x = _f32(a[0], rows * cols).reshape(rows, cols)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    _f32(a[1], rows * cols).reshape(rows, cols)[:] = e / e.sum(axis=1, keepdims=True)


def _elems(n: int, *idx: int) -> dict[int, int]:
    return {i: max(n, 0) * F32 for i in idx}


STD: dict[str, StdKernel] = {
    "vector_add_f32": StdKernel(("buf", "buf", "buf", "i32"), lambda a: _elems(a[3], 0, 1, 2), _vector_add),
    "saxpy_f32": StdKernel(("f32", "buf", "buf", "i32"), lambda a: _elems(a[3], 1, 2), _saxpy),
    "scale_f32": StdKernel(("buf", "f32", "i32"), lambda a: _elems(a[2], 0), _scale),
    "relu_f32": StdKernel(("buf", "buf", "i32"), lambda a: _elems(a[2], 0, 1), _relu),
    "sum_f32": StdKernel(("buf", "buf", "i32"), lambda a: {0: max(a[2], 0) * F32, 1: F32}, _sum),
    "gemm_f32": StdKernel(
        ("buf", "buf", "buf", "i32", "i32", "i32"),
        lambda a: {0: a[3] * a[5] * F32, 1: a[5] * a[4] * F32, 2: a[3] * a[4] * F32},
        _gemm,
    ),
    "softmax_rows_f32": StdKernel(
        ("buf", "buf", "i32", "i32"), lambda a: _elems(a[2] * a[3], 0, 1), _softmax
    ),
}

# Scalars that must not be negative (dimensions and counts).
NON_NEGATIVE = {
    "vector_add_f32": (3,),
    "saxpy_f32": (3,),
    "scale_f32": (2,),
    "relu_f32": (2,),
    "sum_f32": (2,),
    "gemm_f32": (3, 4, 5),
    "softmax_rows_f32": (2, 3),
}
