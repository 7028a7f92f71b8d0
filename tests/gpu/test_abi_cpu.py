"""The tensorwasm ABI on the CPU backend, through the HTTP API and real guests.

These tests assert the CPU backend's answers (its device info, its refusal of run-time CUDA C),
so they run it whatever TENSORWASM_TEST_BACKEND says; tests/gpu/test_cuda.py asserts CUDA's."""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest

from app.gpu.kernel_runner import PATH_STEPS, TIME_LAUNCHES, TIME_PATH, TIME_STEPS
from app.kernels.std_numpy import STD
from tests.gpu.runner import Buf, abi_code, blocks, f32, rec_buf, rec_f32, rec_i32, request
from tests.gpu.std_cases import case
from tests.helpers import ADMIN, deploy, make_settings, new_tenant, running_app

CAP = 1 << 20


@pytest.fixture(scope="module")
async def client(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    settings = make_settings(database_url, tmp_path_factory.mktemp("abi-cpu"), backend="cpu")
    async with running_app(settings) as (client, _):
        yield client


async def run(client: httpx.AsyncClient, key: dict, name: str, body: bytes) -> httpx.Response:
    return await client.post(f"/v1/functions/{name}/invoke", content=body, headers=key)


@pytest.fixture
async def gpu_tenant(client: httpx.AsyncClient, c_guest) -> dict:
    _, key = await new_tenant(client, gpu_memory_bytes=CAP)
    assert (await deploy(client, key, "runner", c_guest("kernel_runner.c"))).status_code == 201
    return key


async def test_abi_probe_refuses_every_bad_input(client: httpx.AsyncClient, c_guest) -> None:
    _, key = await new_tenant(client, gpu_memory_bytes=CAP)
    await deploy(client, key, "probe", c_guest("abi_probe.c"))
    r = await run(client, key, "probe", b"")
    assert r.status_code == 200, r.text
    got = dict(line.split("=", 1) for line in r.text.splitlines())
    info = json.loads(got.pop("device_info_json"))
    assert info == {"backend": "cpu", "name": "cpu", "compute_capability": "", "memory_cap_bytes": CAP, "memory_used_bytes": 0}
    assert "would exceed the tenant GPU memory cap" in got.pop("alloc_over_cap_error")
    expected = {
        "device_count": 0,
        "last_error_none": 0,
        "alloc_zero": -7,
        "alloc_negative": -7,
        "alloc_over_cap": -6,
        "alloc_ok": 1,
        "size": 64,
        "read_new_is_zero": 0,
        "new_buffer_zeroed": 1,
        "write_src_outside_memory": -2,
        "write_range_outside_buffer": -7,
        "write_negative_offset": -7,
        "write_negative_len": -7,
        "read_dst_outside_memory": -2,
        "read_past_end": -7,
        "copy_ok": 0,
        "copy_out_of_range": -7,
        "copy_bad_handle": -3,
        "free_bad_handle": -3,
        "free_ok": 0,
        "free_twice": -3,
        "size_after_free": -3,
        "module_get_unknown": -8,
        "module_get_name_outside_memory": -2,
        "module_load_bad_format": -7,
        "module_load_cuda": -1,  # CPU worker: UNAVAILABLE
        "module_get_std": 1,
        "function_get_unknown": -8,
        "function_get_bad_module": -3,
        "function_get_buffer_as_module": -3,
        "function_get_ok": 1,
        "launch_ok": 0,
        "launch_zero_grid": -7,
        "launch_block_too_big": -7,
        "launch_negative_shared": -7,
        "launch_bad_function": -3,
        "launch_args_outside_memory": -2,
        "launch_args_too_long": -7,
        "launch_unknown_tag": -7,
        "launch_truncated_record": -7,
        "launch_bad_buffer_handle": -3,
        "launch_offset_past_end": -7,
        "launch_wrong_arg_types": -7,
        "launch_n_past_buffer": -7,
        "launch_negative_n": -7,
        "launch_cached_ok": 0,
        "launch_cached_again": 0,
        "launch_after_free": -3,
        "synchronize": 0,
        "module_get_std_again": 1,
    }
    assert int(got.pop("last_error_truncated_len")) > 4  # full length, though only 4 bytes were written
    assert {k: int(v) for k, v in got.items()} == expected


@pytest.mark.parametrize("name", sorted(STD))
async def test_std_matches_numpy_references(client: httpx.AsyncClient, gpu_tenant: dict, name: str) -> None:
    rng = np.random.default_rng()
    sizes = [1, 37, 130, 257] if name in ("gemm_f32", "softmax_rows_f32") else [0, 1, 255, 257, 10_007]
    for n in sizes:
        req, check = case(name, rng, n)
        r = await run(client, gpu_tenant, "runner", req)
        assert r.status_code == 200, (n, r.text)
        check(r.content)


async def test_the_runner_times_each_step_of_its_path(client: httpx.AsyncClient, gpu_tenant: dict) -> None:
    """The GPU bench's split of the guest's path (examples/kernel_runner.c, TIME_STEPS): after the
    launch and path timings, one u64 per step, then the output."""
    x = np.arange(1024, dtype=np.float32)
    flags = TIME_LAUNCHES | TIME_PATH | TIME_STEPS
    req = request("scale_f32", [Buf(x.nbytes, f32(x))], [rec_buf(0), rec_f32(3.0), rec_i32(x.size)], [0], grid=blocks(x.size), flags=flags)
    r = await run(client, gpu_tenant, "runner", req)
    assert r.status_code == 200, r.text
    launch, total, *steps = struct.unpack(f"<{2 + len(PATH_STEPS)}Q", r.content[: 8 * (2 + len(PATH_STEPS))])
    np.testing.assert_array_equal(np.frombuffer(r.content[8 * (2 + len(PATH_STEPS)) :], dtype=np.float32), x * 3)
    assert sum(steps) == total  # consecutive stretches of the whole path
    assert steps[PATH_STEPS.index("launch and sync")] == launch
    assert all(s > 0 for s in steps)


async def test_vector_add_example(client: httpx.AsyncClient, c_guest) -> None:
    _, key = await new_tenant(client, gpu_memory_bytes=CAP)
    await deploy(client, key, "vadd", c_guest("vector_add.c"))
    a = np.arange(1000, dtype=np.float32)
    b = np.full(1000, 0.5, dtype=np.float32)
    r = await run(client, key, "vadd", a.tobytes() + b.tobytes())
    assert r.status_code == 200
    np.testing.assert_array_equal(np.frombuffer(r.content, dtype=np.float32), a + b)


async def test_runtime_kernel_example_needs_a_gpu(client: httpx.AsyncClient, c_guest) -> None:
    _, key = await new_tenant(client, gpu_memory_bytes=CAP)
    await deploy(client, key, "rk", c_guest("runtime_kernel.c"))
    r = await run(client, key, "rk", f32(np.ones(4)))
    assert r.status_code == 500 and r.json()["error"]["exit_code"] == 3
    assert "no GPU" in r.json()["error"]["stderr_tail"]


async def test_cap_is_enforced_and_released(client: httpx.AsyncClient, gpu_tenant: dict) -> None:
    # exactly the cap fits
    full = request("scale_f32", [Buf(CAP)], [rec_buf(0), rec_f32(1), rec_i32(0)], [])
    assert (await run(client, gpu_tenant, "runner", full)).status_code == 200
    # one byte more does not, and the guest is told why
    over = request("scale_f32", [Buf(CAP // 2), Buf(CAP // 2 + 1)], [rec_buf(0), rec_f32(1), rec_i32(0)], [])
    r = await run(client, gpu_tenant, "runner", over)
    err = r.json()["error"]
    assert abi_code(err["exit_code"]) == -6 and "exceed the tenant GPU memory cap" in err["stderr_tail"]
    # the previous calls' buffers were released when they ended (none were freed by the guest)
    for _ in range(3):
        assert (await run(client, gpu_tenant, "runner", full)).status_code == 200
    usage = (await client.get("/v1/usage", headers=gpu_tenant)).json()
    assert usage["gpu_bytes_in_use"] == 0 and usage["quota"]["gpu_memory_bytes"] == CAP


async def test_new_buffers_are_zero_and_no_residue_crosses_tenants(client: httpx.AsyncClient, gpu_tenant: dict, c_guest) -> None:
    secret = np.full(4096, 1234.5, dtype=np.float32)
    write = request("scale_f32", [Buf(secret.nbytes, f32(secret))], [rec_buf(0), rec_f32(1), rec_i32(4096)], [0])
    r = await run(client, gpu_tenant, "runner", write)
    np.testing.assert_array_equal(np.frombuffer(r.content, dtype=np.float32), secret)
    fresh = request("scale_f32", [Buf(secret.nbytes)], [rec_buf(0), rec_f32(1), rec_i32(0)], [0])
    # the same tenant's next call
    assert (await run(client, gpu_tenant, "runner", fresh)).content == bytes(secret.nbytes)
    # another tenant
    _, other = await new_tenant(client, gpu_memory_bytes=CAP)
    await deploy(client, other, "runner", c_guest("kernel_runner.c"))
    assert (await run(client, other, "runner", fresh)).content == bytes(secret.nbytes)


async def test_zero_gpu_quota_is_unavailable(client: httpx.AsyncClient, c_guest) -> None:
    _, key = await new_tenant(client, gpu_memory_bytes=0)
    await deploy(client, key, "runner", c_guest("kernel_runner.c"))
    r = await run(client, key, "runner", request("scale_f32", [Buf(16)], [], []))
    err = r.json()["error"]
    assert abi_code(err["exit_code"]) == -1 and "no GPU access" in err["stderr_tail"]
    r = await run(client, key, "runner", request("scale_f32", [], [], []))
    assert abi_code(r.json()["error"]["exit_code"]) == -1  # module_get("std") too


async def test_per_instance_buffer_limit(app_factory, c_guest) -> None:
    async with app_factory(max_buffers_per_instance=4, backend="cpu") as (client, _):
        _, key = await new_tenant(client, gpu_memory_bytes=CAP)
        await deploy(client, key, "runner", c_guest("kernel_runner.c"))
        ok = request("scale_f32", [Buf(8)] * 4, [rec_buf(0), rec_f32(1), rec_i32(0)], [])
        assert (await run(client, key, "runner", ok)).status_code == 200
        r = await run(client, key, "runner", request("scale_f32", [Buf(8)] * 5, [], []))
        err = r.json()["error"]
        assert abi_code(err["exit_code"]) == -6 and "live buffers per instance" in err["stderr_tail"]


async def test_tenant_kernels_api(client: httpx.AsyncClient, gpu_tenant: dict) -> None:
    src = 'extern "C" __global__ void twice(float* x, int n) { int i = threadIdx.x; if (i < n) x[i] *= 2; }'
    hdr = {**gpu_tenant, "Content-Type": "text/plain"}
    r = await client.put("/v1/kernels/mykern", content=src, headers=hdr)
    assert r.status_code == 201 and r.json()["size"] == len(src)
    assert (await client.put("/v1/kernels/mykern", content=src + "\n", headers=hdr)).status_code == 200
    assert [k["name"] for k in (await client.get("/v1/kernels", headers=gpu_tenant)).json()] == ["mykern"]
    assert (await client.get("/v1/kernels/mykern", headers=gpu_tenant)).json()["source"] == src + "\n"
    assert (await client.put("/v1/kernels/std", content=src, headers=hdr)).status_code == 409
    assert (await client.put("/v1/kernels/empty", content=" ", headers=hdr)).status_code == 422
    assert (await client.put("/v1/kernels/bin", content=b"\xff\xfe", headers=hdr)).status_code == 422
    assert (await client.put("/v1/kernels/x", content=src, headers={**gpu_tenant, "Content-Type": "image/png"})).status_code == 415

    # reachable by name from a guest; on a CPU worker it cannot run
    r = await run(client, gpu_tenant, "runner", request("twice", [Buf(8)], [rec_buf(0), rec_i32(2)], [0], module="mykern"))
    assert abi_code(r.json()["error"]["exit_code"]) == -1
    r = await run(client, gpu_tenant, "runner", request("twice", [Buf(8)], [], [], module="unknown"))
    assert abi_code(r.json()["error"]["exit_code"]) == -8

    # private to the tenant
    _, other = await new_tenant(client, gpu_memory_bytes=CAP)
    assert (await client.get("/v1/kernels/mykern", headers=other)).status_code == 404
    assert (await client.get("/v1/kernels", headers=other)).json() == []
    assert (await client.delete("/v1/kernels/mykern", headers=other)).status_code == 404
    assert (await client.delete("/v1/kernels/mykern", headers=gpu_tenant)).status_code == 204
    assert (await client.get("/v1/kernels/mykern", headers=gpu_tenant)).status_code == 404
    r = await run(client, gpu_tenant, "runner", request("twice", [Buf(8)], [], [], module="mykern"))
    assert abi_code(r.json()["error"]["exit_code"]) == -8  # gone for guests too


async def test_admin_workers_show_cap(client: httpx.AsyncClient, gpu_tenant: dict) -> None:
    await run(client, gpu_tenant, "runner", request("scale_f32", [Buf(8)], [rec_buf(0), rec_f32(1), rec_i32(2)], []))
    workers = (await client.get("/v1/admin/workers", headers=ADMIN)).json()
    assert any(w["gpu_bytes_cap"] == CAP and w["gpu_bytes_in_use"] == 0 for w in workers)


async def test_large_copies_copy_at_the_call_and_respect_ranges(client: httpx.AsyncClient, c_guest) -> None:
    _, key = await new_tenant(client, gpu_memory_bytes=64 << 20, wasm_memory_bytes=64 << 20)
    await deploy(client, key, "big", c_guest("big_copies.c"))
    for _ in range(2):  # the second call runs in the reused guest memory
        r = await run(client, key, "big", b"")
        assert r.status_code == 200 and r.text == "ok", r.text
