"""The ABI on a real GPU (CUDA backend through CuPy). Marked `gpu`: skipped without one.

Run on a GPU machine with `pytest -m gpu`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from app.kernels.std_numpy import STD
from tests.gpu.runner import Buf, abi_code, f32, rec_buf, rec_f32, rec_i32, request
from tests.gpu.std_cases import case
from tests.helpers import ADMIN, deploy, make_settings, new_tenant, running_app

pytestmark = pytest.mark.gpu
CAP = 256 << 20

WILD = 'extern "C" __global__ void wild(float* x, int n) { float* p = (float*)0x10; p[threadIdx.x] = 1.0f; }'
ENDLESS = 'extern "C" __global__ void spin(float* x, int n) { volatile int k = 1; while (k) { x[0] += 1.0f; } }'
SQUARE = 'extern "C" __global__ void sq(float* x, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] = x[i] * x[i]; }'


@pytest.fixture(scope="module")
async def gpu(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    settings = make_settings(database_url, Path(tmp_path_factory.mktemp("gpu")), backend="cuda", max_workers=4, warm_spares=1, worker_start_timeout_s=120)
    async with running_app(settings) as pair:
        yield pair


async def _tenant(client: httpx.AsyncClient, c_guest, cap: int = CAP, **quota: Any) -> dict:
    _, key = await new_tenant(client, gpu_memory_bytes=cap, **quota)
    assert (await deploy(client, key, "runner", c_guest("kernel_runner.c"))).status_code == 201
    return key


async def run(client: httpx.AsyncClient, key: dict, body: bytes, name: str = "runner") -> httpx.Response:
    return await client.post(f"/v1/functions/{name}/invoke", content=body, headers=key)


async def test_device_info_and_probe(gpu, c_guest) -> None:
    client, _ = gpu
    _, key = await new_tenant(client, gpu_memory_bytes=CAP)
    await deploy(client, key, "probe", c_guest("abi_probe.c"))
    r = await run(client, key, b"", "probe")
    assert r.status_code == 200, r.text
    got = dict(line.split("=", 1) for line in r.text.splitlines())
    info = json.loads(got["device_info_json"])
    assert info["backend"] == "cuda" and info["compute_capability"] and info["memory_cap_bytes"] == CAP
    assert got["device_count"] == "1"
    assert int(got["module_load_cuda"]) > 0
    for probe in ("alloc_over_cap", "launch_n_past_buffer", "launch_offset_past_end"):
        assert int(got[probe]) < 0, probe
    assert got["new_buffer_zeroed"] == "1" and got["launch_ok"] == "0" and got["synchronize"] == "0"
    assert got["launch_cached_again"] == "0" and got["launch_after_free"] == "-3"


@pytest.mark.parametrize("name", sorted(STD))
async def test_std_kernels_match_numpy(gpu, c_guest, name: str) -> None:
    client, _ = gpu
    key = await _tenant(client, c_guest)
    rng = np.random.default_rng()
    sizes = [1, 37, 300, 1023] if name in ("gemm_f32", "softmax_rows_f32") else [0, 1, 255, 257, 100_003, int(rng.integers(1, 1 << 20))]
    for n in sizes:
        req, check = case(name, rng, n)
        r = await run(client, key, req)
        assert r.status_code == 200, (name, n, r.text)
        check(r.content)


async def test_runtime_compiled_kernel(gpu, c_guest) -> None:
    client, _ = gpu
    _, key = await new_tenant(client, gpu_memory_bytes=CAP)
    await deploy(client, key, "rk", c_guest("runtime_kernel.c"))
    x = np.random.default_rng().standard_normal(1000).astype(np.float32)
    r = await run(client, key, f32(x), "rk")
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.frombuffer(r.content, dtype=np.float32), x * x + 1, rtol=1e-6)


async def test_ptx_module_and_compile_errors(gpu, c_guest) -> None:
    import cupy
    from cupy_backends.cuda.libs import nvrtc

    client, _ = gpu
    key = await _tenant(client, c_guest)
    prog = nvrtc.createProgram(SQUARE, "sq.cu", [], [])
    cc = cupy.cuda.Device().compute_capability
    nvrtc.compileProgram(prog, [f"--gpu-architecture=compute_{cc}"])  # PTX, JIT-compiled by the driver
    ptx = nvrtc.getPTX(prog)
    nvrtc.destroyProgram(prog)
    x = np.arange(100, dtype=np.float32)
    module = ptx.encode() if isinstance(ptx, str) else ptx
    req = request("sq", [Buf(400, f32(x))], [rec_buf(0), rec_i32(100)], [0], grid=(1, 1, 1), block=(128, 1, 1), module=module, kind=2)
    r = await run(client, key, req)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(np.frombuffer(r.content, dtype=np.float32), x * x)
    bad = request("sq", [Buf(400)], [], [], module=b'extern "C" __global__ void sq( { nope', kind=1)
    r = await run(client, key, bad)
    assert abi_code(r.json()["error"]["exit_code"]) == -4 and "error" in r.json()["error"]["stderr_tail"]
    r = await run(client, key, request("missing", [Buf(4)], [], [], module=SQUARE.encode(), kind=1))
    assert abi_code(r.json()["error"]["exit_code"]) == -8


async def test_tenant_kernel_upload_compiles(gpu, c_guest) -> None:
    client, _ = gpu
    key = await _tenant(client, c_guest)
    hdr = {**key, "Content-Type": "text/plain"}
    r = await client.put("/v1/kernels/broken", content='extern "C" __global__ void k( {', headers=hdr)
    assert r.status_code == 422 and r.json()["error"]["code"] == "compile_failed"
    assert (await client.put("/v1/kernels/square", content=SQUARE, headers=hdr)).status_code == 201
    x = np.arange(1, 301, dtype=np.float32)
    r = await run(client, key, request("sq", [Buf(x.nbytes, f32(x))], [rec_buf(0), rec_i32(300)], [0], grid=(3, 1, 1), block=(128, 1, 1), module="square"))
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(np.frombuffer(r.content, dtype=np.float32), x * x)


async def test_over_cap_allocation_refused(gpu, c_guest) -> None:
    client, _ = gpu
    key = await _tenant(client, c_guest, cap=64 << 20)
    r = await run(client, key, request("scale_f32", [Buf(48 << 20), Buf(32 << 20)], [], []))
    err = r.json()["error"]
    assert abi_code(err["exit_code"]) == -6 and "exceed the tenant GPU memory cap" in err["stderr_tail"]
    r = await run(client, key, request("scale_f32", [Buf(64 << 20)], [rec_buf(0), rec_f32(2), rec_i32(1 << 24)], []))
    assert r.status_code == 200, r.text  # exactly the cap fits


async def test_wild_pointer_fails_only_its_call(gpu, c_guest) -> None:
    client, platform = gpu
    bad = await _tenant(client, c_guest)
    good = await _tenant(client, c_guest)
    x = np.ones(1000, dtype=np.float32)
    good_bufs = [Buf(4000, f32(x)), Buf(4000, f32(x)), Buf(4000)]
    good_req = request("vector_add_f32", good_bufs, [rec_buf(0), rec_buf(1), rec_buf(2), rec_i32(1000)], [2], grid=(4, 1, 1))
    assert (await run(client, good, good_req)).status_code == 200
    assert (await run(client, bad, good_req)).status_code == 200
    restarts = platform.scheduler.restarts["device_error"]

    async def good_calls() -> list[int]:
        out = []
        for _ in range(20):
            r = await run(client, good, good_req)
            out.append(r.status_code)
            np.testing.assert_array_equal(np.frombuffer(r.content, dtype=np.float32), x + x)
        return out

    wild = request("wild", [Buf(64)], [rec_buf(0), rec_i32(1)], [0], module=WILD.encode(), kind=1)
    bad_r, good_codes = await asyncio.gather(run(client, bad, wild), good_calls())
    assert bad_r.status_code == 500 and bad_r.json()["error"]["code"] in ("device_error", "guest_error"), bad_r.text
    assert set(good_codes) == {200}
    assert platform.scheduler.restarts["device_error"] == restarts + 1
    r = await run(client, bad, good_req)  # the tenant gets a fresh context
    assert r.status_code == 200


async def test_endless_kernel_is_504_and_next_call_fine(gpu, c_guest) -> None:
    client, platform = gpu
    key = await _tenant(client, c_guest, timeout_ms=1000)
    spin = request("spin", [Buf(64)], [rec_buf(0), rec_i32(1)], [0], module=ENDLESS.encode(), kind=1)
    r = await run(client, key, spin)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    x = np.ones(10, dtype=np.float32)
    r = await run(client, key, request("relu_f32", [Buf(40, f32(-x)), Buf(40)], [rec_buf(0), rec_buf(1), rec_i32(10)], [1]))
    assert r.status_code == 200 and np.frombuffer(r.content, dtype=np.float32).sum() == 0
    assert platform.scheduler.restarts["hard_timeout"] >= 1


async def test_workers_report_gpu_bytes(gpu, c_guest) -> None:
    client, platform = gpu
    key = await _tenant(client, c_guest)
    await run(client, key, request("scale_f32", [Buf(4096)], [], []))
    workers = (await client.get("/v1/admin/workers", headers=ADMIN)).json()
    assert all(w["backend"] == "cuda" for w in workers if w["state"] != "starting")
    assert any(w["gpu_bytes_cap"] == CAP for w in workers)


async def test_large_copies_through_pinned_guest_memory(gpu, c_guest) -> None:
    """9 MiB copies take the page-locked path from the second 2 MiB chunk on; repeated calls
    reuse the pinned chunks. Every byte is checked inside the guest."""
    client, _ = gpu
    _, key = await new_tenant(client, gpu_memory_bytes=CAP, wasm_memory_bytes=64 << 20)
    await deploy(client, key, "big", c_guest("big_copies.c"))
    for _ in range(3):
        r = await run(client, key, b"", "big")
        assert r.status_code == 200 and r.text == "ok", r.text
