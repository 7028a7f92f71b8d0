"""A CUDA buffer reads as zeros wherever its guest did not write, though the backend zeroes it
only at its first use (app/gpu/cuda.py): a block the pool hands out again after a call filled it
is zeroed before a read, a copy, a kernel or a partial write; a whole write needs no zeroing."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.gpu.cuda import cuda_available
from app.gpu.signatures import FORMAT_CUDA

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device (run on the GPU machine)")]

N = 1 << 16  # float32 elements
ADD1 = 'extern "C" __global__ void add1(float* x, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] += 1.0f; }'


@pytest.fixture(scope="module", params=["managed", "device"])
def backend(request: pytest.FixtureRequest) -> Any:
    from app.gpu.cuda import CudaBackend

    b = CudaBackend(Path(tempfile.mkdtemp()), request.param)
    b.set_cap(1 << 30)
    return b


def _dirty_block(backend: Any) -> Any:
    """A buffer on a block the last "call" filled with 7s, handed out again by the pool."""
    junk = np.full(N, 7.0, dtype=np.float32)
    buf = backend.alloc(4 * N)
    backend.write(buf, 0, junk.ctypes.data, 4 * N)
    backend.synchronize()
    ptr = buf.ptr
    backend.end_invocation()
    del buf
    again = backend.alloc(4 * N)
    assert again.ptr == ptr  # the same block: what this test is about
    return again


def _read(backend: Any, buf: Any) -> np.ndarray:
    out = np.empty(N, dtype=np.float32)
    backend.read(buf, 0, out.ctypes.data, 4 * N)
    return out


def test_a_reused_block_reads_as_zeros(backend: Any) -> None:
    assert not _read(backend, _dirty_block(backend)).any()


def test_a_partial_write_leaves_zeros_around_it(backend: Any) -> None:
    buf = _dirty_block(backend)
    part = np.arange(8, dtype=np.float32) + 1
    backend.write(buf, 64, part.ctypes.data, part.nbytes)
    got = _read(backend, buf)
    assert np.array_equal(got[16:24], part)
    assert not got[:16].any() and not got[24:].any()


def test_a_kernel_and_a_copy_see_zeros(backend: Any) -> None:
    buf = _dirty_block(backend)
    fn = backend.get_function(backend.load_module(ADD1.encode(), FORMAT_CUDA), "add1")
    backend.prepare(fn, (N // 256, 1, 1), (256, 1, 1), 0, [(buf, 0), np.int32(N)])()
    assert np.array_equal(_read(backend, buf), np.ones(N, dtype=np.float32))
    src = _dirty_block(backend)
    dst = backend.alloc(4 * N)
    backend.copy(dst, 0, src, 0, 4 * N)
    assert not _read(backend, dst).any()


def test_a_whole_write_is_what_is_read(backend: Any) -> None:
    buf = _dirty_block(backend)
    data = np.random.default_rng(1).standard_normal(N).astype(np.float32)
    backend.write(buf, 0, data.ctypes.data, data.nbytes)
    assert np.array_equal(_read(backend, buf), data)
