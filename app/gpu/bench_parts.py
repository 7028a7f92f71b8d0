"""Where a guest's GPU path spends its time, for `tensorwasm bench gpu`: the parts of a launch
and of the 4 MiB path, each timed in the bench's own process next to the raw CuPy step it stands
for.

- `abi_launch_ns`: the host side of one guest `launch` (wasm -> host call, argument records read
  from guest memory, the prepared-launch cache) with the kernel launch itself left out, on the
  CPU backend: what a guest launch costs beyond the driver's.
- `prepared_launch_us`: the CUDA backend's prepared launch (one cuLaunchKernel with its parameter
  array packed once), 1000 in a row then a synchronize, as the raw baseline is timed.
- `path_parts_us`: the 4 MiB path's steps through the CUDA backend (alloc with its zeroing and
  prefetch, host -> device, the kernel, device -> host) against CuPy's (`cupy.empty`, `set`, the
  kernel, `get`), each step synchronized and timed alone.
"""

from __future__ import annotations

import hashlib
import statistics
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from app.gpu.kernel_runner import TIME_LAUNCHES, Buf, rec_buf, rec_f32, rec_i32, request


def abi_launch_ns(wasm: bytes, launches: int = 20_000) -> float:
    """Median ns per launch of the ABI's host path, the launch a no-op (CPU backend)."""
    import wasmtime

    from app.contract.messages import Run
    from app.gpu.abi import AbiHost
    from app.gpu.cpu import CpuBackend
    from app.runtime.artifacts import ArtifactCache
    from app.runtime.engine import make_engine
    from app.runtime.memory import GuestMemory
    from app.runtime.runner import GuestRunner
    from app.runtime.validation import has_start_function

    cache = ArtifactCache(Path(tempfile.mkdtemp(prefix="tensorwasm-bench-")))
    memory = GuestMemory()
    backend = CpuBackend()
    backend.prepare_std = lambda *_a, **_k: (lambda: None)  # type: ignore[method-assign]
    host = AbiHost(backend, 1024, 64, memory)
    host.bind(1 << 20)
    runner = GuestRunner(make_engine(memory), cache, host, 5, memory)
    sha = hashlib.sha256(wasm).hexdigest()
    cache.store(sha, wasmtime.Module(make_engine(), wasm), start_function=has_start_function(wasm))
    body = request("scale_f32", [Buf(64)], [rec_buf(0), rec_f32(1.0), rec_i32(16)], [], block=(16, 1, 1), repeat=launches, flags=TIME_LAUNCHES)
    run = Run(
        invocation_id="bench", function="runner", sha256=sha, env={}, timeout_ms=60_000, wasm_memory_bytes=1 << 26,
        stdout_limit=1 << 20, stderr_limit=1 << 16, kernels={},
    )
    times = []
    for _ in range(9):
        out = runner.run(run, body).stdout
        times.append(struct.unpack("<Q", out[:8])[0] / launches)
    return statistics.median(times[2:])


def _timed(step: Any, sync: Any, reps: int = 15) -> float:
    """Median µs of `step()` followed by `sync()`."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        step()
        sync()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times[3:]) / 1e3


def prepared_launch_us(backend: Any, source: str, name: str) -> float:
    """Per launch: 1000 prepared launches of `name` (one float* and an int), then a synchronize."""
    from app.gpu.signatures import FORMAT_CUDA

    fn = backend.get_function(backend.load_module(source.encode(), FORMAT_CUDA), name)
    buf = backend.alloc(1024)
    launch = backend.prepare(fn, (1, 1, 1), (256, 1, 1), 0, [(buf, 0), np.int32(256)])

    def thousand() -> None:
        for _ in range(1000):
            launch()

    return _timed(thousand, backend.synchronize, reps=7) / 1000


def path_parts_us(cp: Any, backend: Any, source: str, name: str, nbytes: int = 4 << 20) -> dict[str, tuple[float, float]]:
    """Each step of the 4 MiB path: (through the backend, raw CuPy), in µs."""
    from app.gpu.signatures import FORMAT_CUDA

    n = nbytes // 4
    host = np.random.default_rng().standard_normal(n).astype(np.float32)
    back = np.empty_like(host)
    src, dst = host.ctypes.data, back.ctypes.data
    fn = backend.get_function(backend.load_module(source.encode(), FORMAT_CUDA), name)
    raw_fn = cp.RawModule(code=source).get_function(name)
    sync = backend.synchronize
    keep: list[Any] = []

    def alloc() -> None:
        keep.append(backend.alloc(nbytes))

    ours: dict[str, float] = {"alloc": _timed(alloc, sync)}
    buf = keep[-1]
    keep.clear()
    ours["host_to_device"] = _timed(lambda: backend.write(buf, 0, src, nbytes), sync)
    launch = backend.prepare(fn, (n // 256, 1, 1), (256, 1, 1), 0, [(buf, 0), np.int32(n)])
    ours["kernel"] = _timed(launch, sync)
    ours["device_to_host"] = _timed(lambda: backend.read(buf, 0, dst, nbytes), sync)

    d = cp.empty(n, dtype=cp.float32)
    raw_sync = cp.cuda.Device().synchronize
    raw = {
        "alloc": _timed(lambda: keep.append(cp.empty(n, dtype=cp.float32)), raw_sync),
        "host_to_device": _timed(lambda: d.set(host), raw_sync),
        "kernel": _timed(lambda: raw_fn((n // 256,), (256,), (d, np.int32(n))), raw_sync),
        "device_to_host": _timed(lambda: d.get(out=back), raw_sync),
    }
    keep.clear()
    return {step: (ours[step], raw[step]) for step in ours}
