"""The `std` library checked against NumPy: one request builder and reference per kernel."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tests.gpu.runner import Buf, blocks, f32, rec_buf, rec_f32, rec_i32, request

Case = tuple[bytes, Callable[[bytes], None]]


def _vec(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.standard_normal(n).astype(np.float32)


def _check(got: bytes, want: np.ndarray, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    arr = np.frombuffer(got, dtype=np.float32)
    assert arr.shape == want.reshape(-1).shape
    np.testing.assert_allclose(arr, want.reshape(-1), rtol=rtol, atol=atol)


def case(name: str, rng: np.random.Generator, n: int) -> Case:
    if name == "vector_add_f32":
        a, b = _vec(rng, n), _vec(rng, n)
        req = request(name, [Buf(4 * n + 4, f32(a)), Buf(4 * n + 4, f32(b)), Buf(4 * n + 4)], [rec_buf(0), rec_buf(1), rec_buf(2), rec_i32(n)], [2], blocks(n))
        return req, lambda out: _check(out[: 4 * n], a + b)
    if name == "saxpy_f32":
        x, y = _vec(rng, n), _vec(rng, n)
        req = request(name, [Buf(4 * n + 4, f32(x)), Buf(4 * n + 4, f32(y))], [rec_f32(1.5), rec_buf(0), rec_buf(1), rec_i32(n)], [1], blocks(n))
        return req, lambda out: _check(out[: 4 * n], np.float32(1.5) * x + y)
    if name == "scale_f32":
        x = _vec(rng, n)
        req = request(name, [Buf(4 * n + 4, f32(x))], [rec_buf(0), rec_f32(-0.5), rec_i32(n)], [0], blocks(n))
        return req, lambda out: _check(out[: 4 * n], np.float32(-0.5) * x)
    if name == "relu_f32":
        x = _vec(rng, n)
        req = request(name, [Buf(4 * n + 4, f32(x)), Buf(4 * n + 4)], [rec_buf(0), rec_buf(1), rec_i32(n)], [1], blocks(n))
        return req, lambda out: _check(out[: 4 * n], np.maximum(x, 0))
    if name == "sum_f32":
        x = _vec(rng, n)
        start = np.float32(2.0)
        req = request(name, [Buf(4 * n + 4, f32(x)), Buf(4, f32(np.array([start])))], [rec_buf(0), rec_buf(1), rec_i32(n)], [1], blocks(n))
        want = np.array([start + x.astype(np.float64).sum()], dtype=np.float32)
        return req, lambda out: _check(out, want, rtol=1e-4, atol=1e-3 * max(1.0, np.sqrt(n)))
    if name == "gemm_f32":
        m, k, nn = n, max(1, n // 2 + 3), max(1, n + 5)
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, nn)).astype(np.float32)
        req = request(
            name,
            [Buf(4 * m * k, f32(a)), Buf(4 * k * nn, f32(b)), Buf(4 * m * nn, f32(np.full(m * nn, 7.0)))],
            [rec_buf(0), rec_buf(1), rec_buf(2), rec_i32(m), rec_i32(nn), rec_i32(k)],
            [2],
            blocks(m * nn),
        )
        want = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
        return req, lambda out: _check(out, want, rtol=1e-3, atol=1e-3 * np.sqrt(k))
    if name == "softmax_rows_f32":
        rows, cols = n, max(1, (n * 7) % 97 + 1)
        x = (rng.standard_normal((rows, cols)) * 5).astype(np.float32)
        bufs = [Buf(4 * rows * cols, f32(x)), Buf(4 * rows * cols)]
        req = request(name, bufs, [rec_buf(0), rec_buf(1), rec_i32(rows), rec_i32(cols)], [1], blocks(rows * cols))
        e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
        return req, lambda out: _check(out, (e / e.sum(axis=1, keepdims=True)).astype(np.float32), rtol=1e-4, atol=1e-6)
    raise KeyError(name)
