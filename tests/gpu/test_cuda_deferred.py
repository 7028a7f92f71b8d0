"""The CUDA backend notes a call that used its deferred set-up (a gemm, through cuBLAS's handle),
so the node can have the tenant's next workers make it ahead; other kernels and the idle warm-up
itself do not count (app/gpu/cuda.py, `deferred_used`)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.gpu.cuda import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device (run on the GPU machine)")]

M = 64


def _buf(backend: Any, a: np.ndarray) -> Any:
    buf = backend.alloc(a.nbytes)
    backend.write(buf, 0, a.ctypes.data, a.nbytes)
    return buf


def test_only_a_gemm_counts_as_using_the_deferred_set_up() -> None:
    from app.gpu.cuda import CudaBackend

    backend = CudaBackend(Path(tempfile.mkdtemp()))
    backend.set_cap(1 << 30)
    rng = np.random.default_rng()
    x, y = (rng.standard_normal(M * M).astype(np.float32) for _ in range(2))
    bx, by = _buf(backend, x), _buf(backend, y)
    # buffer arguments go through `view`, as the ABI's launch passes them (zeroed at first use)
    backend.prepare_std("saxpy_f32", (M, 1, 1), (M, 1, 1), [np.float32(2.0), backend.view(bx, 0), backend.view(by, 0), np.int32(M * M)])()
    backend.warm_idle()  # made ahead: not a call's use
    backend.end_invocation()
    assert not backend.deferred_used
    bc = backend.alloc(4 * M * M)
    backend.prepare_std("gemm_f32", (1, 1, 1), (1, 1, 1), [backend.view(bx, 0), backend.view(by, 0), backend.view(bc, 0), M, M, M])()
    out = np.empty(M * M, dtype=np.float32)
    backend.read(bc, 0, out.ctypes.data, out.nbytes)
    np.testing.assert_allclose(out.reshape(M, M), x.reshape(M, M) @ (y + 2 * x).reshape(M, M), rtol=1e-3, atol=1e-3)
    assert backend.deferred_used
