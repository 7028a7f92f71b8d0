"""The parts `tensorwasm bench gpu` times (app/gpu/bench_parts.py)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from app.gpu.bench_parts import abi_launch_ns, path_parts_us, prepared_launch_us
from app.gpu.cuda import cuda_available

SCALE = 'extern "C" __global__ void scale2(float* x, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= 2.0f; }'


def test_the_abi_host_path_of_a_launch_is_timed_without_a_kernel(c_guest: Callable[[str], bytes]) -> None:
    ns = abi_launch_ns(c_guest("kernel_runner.c"), launches=2000)
    assert 100 < ns < 100_000  # microseconds, not the nanoseconds of a clock read or a stalled run


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device (run on the GPU machine)")
def test_the_cuda_parts_are_timed_against_cupy() -> None:
    import cupy as cp

    from app.gpu.cuda import CudaBackend

    backend = CudaBackend(Path(tempfile.mkdtemp()))
    backend.set_cap(1 << 30)
    assert 0 < prepared_launch_us(backend, SCALE, "scale2") < 1000
    parts = path_parts_us(cp, backend, SCALE, "scale2", nbytes=1 << 20)
    assert set(parts) == {"alloc", "host_to_device", "kernel", "device_to_host"}
    assert all(ours > 0 and raw > 0 for ours, raw in parts.values())
