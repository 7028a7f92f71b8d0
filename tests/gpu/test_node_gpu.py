"""The GPU path behind fronts: a real `tensorwasm serve` with two fronts on the CUDA backend.
Marked `gpu`: skipped without one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.gpu.runner import Buf, f32, rec_buf, rec_i32, request
from tests.gpu.test_cuda import WILD
from tests.helpers import ADMIN, ADMIN_TOKEN, deploy, new_tenant, server_process

pytestmark = pytest.mark.gpu
CAP = 256 << 20


async def test_kernels_through_two_fronts_and_a_poisoned_context_replaced(server_database_url: str, tmp_path: Path, c_guest) -> None:
    env = {
        "TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN, "TENSORWASM_BACKEND": "cuda", "TENSORWASM_PROCESSES": "2",
        "TENSORWASM_MAX_WORKERS": "4", "TENSORWASM_WORKER_START_TIMEOUT_S": "120", "TENSORWASM_QUEUE_WAIT_MS": "30000",
    }
    with server_process(tmp_path / "node", server_database_url, env=env) as server:
        limits = httpx.Limits(max_keepalive_connections=0)  # new connections: both fronts serve
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            keys = []
            for _ in range(2):
                _, key = await new_tenant(client, gpu_memory_bytes=CAP)
                assert (await deploy(client, key, "runner", c_guest("kernel_runner.c"))).status_code == 201
                keys.append(key)
            good, bad = keys
            x = np.arange(1000, dtype=np.float32)
            bufs = [Buf(4000, f32(x)), Buf(4000, f32(x)), Buf(4000)]
            add = request("vector_add_f32", bufs, [rec_buf(0), rec_buf(1), rec_buf(2), rec_i32(1000)], [2], grid=(4, 1, 1))

            async def call(key: dict[str, str], body: bytes) -> httpx.Response:
                return await client.post("/v1/functions/runner/invoke", content=body, headers=key)

            replies = await asyncio.gather(*(call(good, add) for _ in range(16)))
            for r in replies:
                assert r.status_code == 200, r.text
                np.testing.assert_array_equal(np.frombuffer(r.content, dtype=np.float32), x + x)
            workers = (await client.get("/v1/admin/workers", headers=ADMIN)).json()
            assert {w["backend"] for w in workers if w["state"] != "starting"} == {"cuda"}

            wild = request("wild", [Buf(64)], [rec_buf(0), rec_i32(1)], [0], module=WILD.encode(), kind=1)
            bad_r, *good_rs = await asyncio.gather(call(bad, wild), *(call(good, add) for _ in range(8)))
            assert bad_r.status_code == 500 and bad_r.json()["error"]["code"] in ("device_error", "guest_error"), bad_r.text
            assert {r.status_code for r in good_rs} == {200}
            assert (await call(bad, add)).status_code == 200  # a fresh context for that tenant
            metrics = (await client.get("/metrics")).text
            assert 'tensorwasm_worker_restarts_total{reason="device_error"} 1.0' in metrics
