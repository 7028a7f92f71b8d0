"""`tensorwasm bench gpu`: guest GPU paths against raw CuPy, measured in the same run.

Run on a GPU machine. Each guest figure is timed inside the guest (WASI monotonic clock) by
examples/kernel_runner.c, so HTTP and process hops are excluded; each baseline is the same
work done directly with CuPy in this process. The launch's raw rounds alternate with the guest's
calls and the medians of both are compared; the other paths' baselines are taken before the
guests and again after them, and each guest figure is judged against the faster of the two.
"""

from __future__ import annotations

import argparse
import statistics
import struct
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from app.bench.node import ADMIN, guest_wasm, server, setup_tenant
from app.gpu import kernel_runner
from app.gpu.kernel_runner import (
    PATH_STEPS,
    TIME_LAUNCHES,
    TIME_PATH,
    TIME_STEPS,
    Buf,
    rec_buf,
    rec_f32,
    rec_i32,
    request,
)

TINY = 'extern "C" __global__ void tiny(float* x, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] += 1.0f; }'
SCALE = 'extern "C" __global__ void scale2(float* x, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= 2.0f; }'


def _runner_wasm() -> bytes:
    return guest_wasm(kernel_runner.SOURCE)


def _median_guest_ns(
    client: httpx.Client, headers: dict[str, str], body: bytes, reps: int, steps: dict[str, float] | None = None,
    flags: int = TIME_PATH | TIME_STEPS,
) -> float:
    """The median of the guest's first timing; with `steps` (a path timed with TIME_STEPS among
    the request's `flags`), also the median µs of each of the path's steps, into it."""
    times, parts = [], []
    for _ in range(reps):
        r = client.post("/v1/functions/runner/invoke", content=body, headers=headers)
        if r.status_code != 200:
            raise RuntimeError(r.text)
        times.append(struct.unpack("<Q", r.content[:8])[0])
        if steps is not None:  # after the launch and path timings the request asked for
            at = 8 * bin(flags & (TIME_LAUNCHES | TIME_PATH)).count("1")
            parts.append(struct.unpack(f"<{len(PATH_STEPS)}Q", r.content[at : at + 8 * len(PATH_STEPS)]))
    if steps is not None:
        steps.update({name: statistics.median(p[i] for p in parts) / 1e3 for i, name in enumerate(PATH_STEPS)})
    return statistics.median(times)


def _tenant(client: httpx.Client, name: str, wasm: bytes) -> dict[str, str]:
    quota: dict[str, Any] = {"gpu_memory_bytes": 1 << 30, "requests_per_second": 1e5, "wasm_memory_bytes": 1 << 30, "timeout_ms": 60_000}
    return setup_tenant(client, name, {"runner": wasm}, **quota)


def _gpu_mem_used_mib() -> float:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True)
    return float(out.stdout.split()[0])


class _Results(dict[str, float]):
    def __setitem__(self, key: str, value: float) -> None:
        print(f"{key:24} {value:10.3f}", flush=True)
        super().__setitem__(key, value)


def bench_gpu(args: argparse.Namespace) -> int:
    import cupy as cp

    res: dict[str, float] = _Results()
    # ---- baselines: raw CuPy in this process ------------------------------------------------
    tiny = cp.RawModule(code=TINY).get_function("tiny")
    scale = cp.RawModule(code=SCALE).get_function("scale2")
    x = cp.zeros(256, dtype=cp.float32)
    n = (4 << 20) // 4
    host = np.random.default_rng().standard_normal(n).astype(np.float32)

    def raw_launch_round_us() -> float:
        """µs per launch of one round: 1000 launches, then a synchronize."""
        t0_ns = time.perf_counter_ns()
        for _ in range(1000):
            tiny((1,), (256,), (x, np.int32(256)))
        cp.cuda.Device().synchronize()
        return (time.perf_counter_ns() - t0_ns) / 1000 / 1e3

    def raw_launch_us() -> float:
        """Median µs per launch: 7 rounds of 1000 launches, each then synchronized."""
        for _ in range(100):
            tiny((1,), (256,), (x, np.int32(256)))
        cp.cuda.Device().synchronize()
        return statistics.median(raw_launch_round_us() for _ in range(7))

    def raw_path_us() -> float:
        """Median µs of the 4 MiB path: a new buffer, host to device, the kernel, device to host."""
        paths = []
        for _ in range(15):
            t0_ns = time.perf_counter_ns()
            d = cp.empty(n, dtype=cp.float32)
            d.set(host)
            scale((n // 256,), (256,), (d, np.int32(n)))
            out = d.get()
            paths.append(time.perf_counter_ns() - t0_ns)
        assert np.allclose(out, host * 2)
        return statistics.median(paths[3:]) / 1e3

    # The baselines are taken before the guests and again after them (they move by a third or
    # more between runs minutes apart on one host); each guest figure is judged against the
    # faster of the two, so a slow moment of the host never flatters the guest.
    res["raw_launch_us"] = raw_launch_us()
    res["raw_4mib_path_us"] = raw_path_us()

    m = 4096
    A = cp.random.standard_normal((m, m), dtype=cp.float32)
    B = cp.random.standard_normal((m, m), dtype=cp.float32)
    C = cp.empty((m, m), dtype=cp.float32)
    cp.matmul(A, B, out=C)
    cp.cuda.Device().synchronize()
    gem = []
    for _ in range(5):
        t0_ns = time.perf_counter_ns()
        for _ in range(10):
            cp.matmul(A, B, out=C)
        cp.cuda.Device().synchronize()
        gem.append((time.perf_counter_ns() - t0_ns) / 10)
    res["raw_gemm4096_ms"] = statistics.median(gem) / 1e6
    del A, B, C
    cp.get_default_memory_pool().free_all_blocks()

    # ---- guests ------------------------------------------------------------------------------
    wasm = _runner_wasm()
    managed_steps: dict[str, float] = {}  # the 4 MiB path's steps, timed in the guest
    device_steps: dict[str, float] = {}
    used_before = _gpu_mem_used_mib()
    with server(TENSORWASM_BACKEND="cuda", TENSORWASM_MAX_WORKERS="4", TENSORWASM_WARM_SPARES="2", TENSORWASM_MAX_REQUEST_BYTES=str(512 << 20)) as base:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        with httpx.Client(base_url=base, timeout=120) as client:
            time.sleep(3)
            workers = [w for w in client.get("/v1/admin/workers", headers=admin).json() if w["state"] == "spare"]
            res["context_overhead_mib"] = (_gpu_mem_used_mib() - used_before) / max(1, len(workers))

            cold = []
            for i in range(5):
                h = _tenant(client, f"cold{i}", wasm)
                time.sleep(1.5)
                body = request("scale_f32", [Buf(64)], [rec_buf(0), rec_f32(1.0), rec_i32(16)], [], block=(16, 1, 1))
                t0 = time.perf_counter()
                client.post("/v1/functions/runner/invoke", content=body, headers=h).raise_for_status()
                cold.append(time.perf_counter() - t0)
            res["gpu_cold_start_ms"] = statistics.median(cold) * 1e3

            h = _tenant(client, "hot", wasm)
            launch = request("tiny", [Buf(1024)], [rec_buf(0), rec_i32(256)], [], module=TINY, kind=1, repeat=1000, flags=TIME_LAUNCHES)
            _median_guest_ns(client, h, launch, 2)
            raw_launch_us()  # warm again after the starts above
            # A guest call's 1000 launches alternate with raw rounds of 1000: raw CuPy's launch
            # moved from 5.3 to 8.6 us within one run on one host, so the launch is judged
            # against raw rounds taken beside the guest's, not minutes before or after. Two raw
            # rounds follow each guest call and the faster counts, so that whatever a round
            # right after the guest's call pays never flatters the guest.
            guest_rounds, raw_first, raw_second = [], [], []
            for _ in range(9):
                raw_first.append(raw_launch_round_us())
                raw_second.append(raw_launch_round_us())
                guest_rounds.append(_median_guest_ns(client, h, launch, 1) / 1000 / 1e3)
            res["guest_launch_us"] = statistics.median(guest_rounds)
            res["raw_launch_beside_us"] = statistics.median(map(min, raw_first, raw_second))
            res["raw_launch_beside_first_us"] = statistics.median(raw_first)
            res["raw_launch_beside_second_us"] = statistics.median(raw_second)
            spread = f"{min(guest_rounds):.2f}-{max(guest_rounds):.2f}"

            path = request(
                "scale2", [Buf(4 << 20, host.tobytes())], [rec_buf(0), rec_i32(n)], [0], grid=(n // 256, 1, 1), module=SCALE, kind=1,
                flags=TIME_PATH | TIME_STEPS,
            )
            _median_guest_ns(client, h, path, 3)
            res["guest_4mib_path_us"] = _median_guest_ns(client, h, path, 11, managed_steps) / 1e3

    # the same paths with plain device memory instead of managed memory
    with server(TENSORWASM_BACKEND="cuda", TENSORWASM_MAX_WORKERS="2", TENSORWASM_WARM_SPARES="1", TENSORWASM_GPU_MEMORY="device") as base:
        with httpx.Client(base_url=base, timeout=120) as client:
            h = _tenant(client, "dev", wasm)
            _median_guest_ns(client, h, path, 3)
            res["guest_4mib_path_device_mem_us"] = _median_guest_ns(client, h, path, 11, device_steps) / 1e3
            _median_guest_ns(client, h, launch, 2)
            res["guest_launch_device_mem_us"] = _median_guest_ns(client, h, launch, 7) / 1000 / 1e3
    with server(TENSORWASM_BACKEND="cuda", TENSORWASM_MAX_WORKERS="2", TENSORWASM_WARM_SPARES="1", TENSORWASM_MAX_REQUEST_BYTES=str(512 << 20)) as base:
        with httpx.Client(base_url=base, timeout=120) as client:
            h = _tenant(client, "gemm", wasm)
            # a 4 MiB random pattern, tiled by the guest over each 64 MiB matrix (never time on zeros)
            a = np.random.default_rng().standard_normal(1 << 20).astype(np.float32).tobytes()
            gemm = request(
                "gemm_f32",
                [Buf(4 * m * m, a), Buf(4 * m * m, a[::-1]), Buf(4 * m * m)],
                [rec_buf(0), rec_buf(1), rec_buf(2), rec_i32(m), rec_i32(m), rec_i32(m)],
                [],
                grid=(m * m // 256, 1, 1),
                repeat=10,
                flags=TIME_LAUNCHES,
            )
            _median_guest_ns(client, h, gemm, 1)
            res["guest_gemm4096_ms"] = _median_guest_ns(client, h, gemm, 3) / 10 / 1e6

    res["raw_launch_after_us"] = raw_launch_us()
    res["raw_4mib_path_after_us"] = raw_path_us()
    raw_path = min(res["raw_4mib_path_us"], res["raw_4mib_path_after_us"])

    # ---- where the guest's time goes: the parts, in this process --------------------------------
    parts: dict[str, tuple[float, float]] = {}
    try:
        from app.gpu.bench_parts import abi_launch_ns, path_parts_us, prepared_launch_us
        from app.gpu.cuda import CudaBackend

        res["abi_launch_host_us"] = abi_launch_ns(wasm) / 1e3
        backend = CudaBackend(Path(tempfile.mkdtemp(prefix="tensorwasm-bench-")))
        backend.set_cap(1 << 30)
        res["prepared_launch_us"] = prepared_launch_us(backend, TINY, "tiny")
        parts = path_parts_us(cp, backend, SCALE, "scale2")
    except Exception as exc:  # the parts explain the figures above; a failure leaves those standing
        print(f"the parts could not be timed: {type(exc).__name__}: {exc}")

    rows = [
        ("guest launch / raw CuPy launch (alternated)", res["guest_launch_us"] / res["raw_launch_beside_us"], "<= 1.2x", lambda r: r <= 1.2),
        ("guest 4 MiB path / raw CuPy (managed memory)", res["guest_4mib_path_us"] / raw_path, "<= 1.1x", lambda r: r <= 1.1),
        ("guest 4 MiB path / raw CuPy (device memory)", res["guest_4mib_path_device_mem_us"] / raw_path, "<= 1.3x", lambda r: r <= 1.3),
        ("std gemm_f32 4096 / cupy.matmul (speed)", res["raw_gemm4096_ms"] / res["guest_gemm4096_ms"], ">= 0.8x", lambda r: r >= 0.8),
        ("GPU cold start (ms, warm spare)", res["gpu_cold_start_ms"], "<= 20 ms", lambda r: r <= 20),
    ]
    print(f"\nraw CuPy, before the guests / beside the guest's launches / after them: launch {res['raw_launch_us']:.2f} / "
          f"{res['raw_launch_beside_us']:.2f} / {res['raw_launch_after_us']:.2f} us (the launch is judged against the rounds beside "
          f"the guest's, whose rounds took {spread} us a launch); 4 MiB path {res['raw_4mib_path_us']:.1f} / "
          f"{res['raw_4mib_path_after_us']:.1f} us (judged against the faster)")
    print(f"\n{'metric':42} {'value':>8}  {'target':9} ok")
    for name, value, target, ok in rows:
        print(f"{name:42} {value:8.2f}  {target:9} {'yes' if ok(value) else 'NO'}")
    if "abi_launch_host_us" in res and "prepared_launch_us" in res:
        rest = res["guest_launch_us"] - res["abi_launch_host_us"] - res["prepared_launch_us"]
        print(
            f"\nguest launch {res['guest_launch_us']:.2f} us: the ABI's host path {res['abi_launch_host_us']:.2f} us "
            f"(no kernel) + the prepared cuLaunchKernel {res['prepared_launch_us']:.2f} us + {rest:.2f} us outside both "
            f"(each part is timed alone, its code and data hot; in the guest they run in turn); raw CuPy beside it {res['raw_launch_beside_us']:.2f} us"
        )
    if parts:
        print(f"\n{'4 MiB path step (us)':24} {'backend':>9} {'raw CuPy':>9}")
        for step, (ours, raw) in parts.items():
            print(f"{step:24} {ours:9.1f} {raw:9.1f}")
        print(f"{'sum':24} {sum(o for o, _ in parts.values()):9.1f} {sum(r for _, r in parts.values()):9.1f}")
    _print_steps(managed_steps, device_steps, res)
    return 0


def _print_steps(managed: dict[str, float], device: dict[str, float], res: dict[str, float]) -> None:
    """The guest's 4 MiB path step by step, as the guest timed it (medians of each step, so they
    need not add up to the median of the whole)."""
    if not managed:
        return
    print(f"\n{'4 MiB path in the guest (us)':28} {'managed':>9} {'device':>9}")
    for step in PATH_STEPS:
        print(f"{step:28} {managed[step]:9.1f} {device.get(step, float('nan')):9.1f}")
    print(f"{'steps summed':28} {sum(managed.values()):9.1f} {sum(device.values()) if device else float('nan'):9.1f}")
    print(f"{'the whole path (median)':28} {res['guest_4mib_path_us']:9.1f} {res.get('guest_4mib_path_device_mem_us', float('nan')):9.1f}")
