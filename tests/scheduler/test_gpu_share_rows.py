"""The scheduler's side of GPU time by tenant weight (app/gpu/share.py): a row of the node's share
table per GPU worker, bound by the worker to its tenant and weight, charged by its launches, read
into `tensorwasm_gpu_seconds_total` and given back when the worker goes. The workers run the CPU
backend on fake GPUs; the policy itself is tested in tests/gpu/test_share.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import app.scheduler.scheduler as scheduler_module
from app.gpu.share import ShareTable, tenant_key
from tests.gpu.runner import Buf, f32, rec_buf, rec_i32, request
from tests.helpers import ADMIN, deploy, fake_gpus, new_tenant, until

N = 1 << 16
X = np.arange(N, dtype=np.float32)
ADD = request(
    "vector_add_f32", [Buf(4 * N, f32(X)), Buf(4 * N, f32(X)), Buf(4 * N)], [rec_buf(0), rec_buf(1), rec_buf(2), rec_i32(N)], [2],
    grid=(N // 256, 1, 1), repeat=20,
)


async def _runner(client: Any, c_guest: Any, **quota: Any) -> tuple[str, dict[str, str]]:
    tid, key = await new_tenant(client, **quota)
    assert (await deploy(client, key, "runner", c_guest("kernel_runner.c"))).status_code == 201
    return tid, key


async def test_each_gpu_worker_charges_its_tenant_row(app_factory, monkeypatch: pytest.MonkeyPatch, c_guest) -> None:
    monkeypatch.setattr(scheduler_module, "discover_devices", fake_gpus(1))
    async with app_factory(max_workers=4, warm_spares=1) as (client, platform):
        s = platform.scheduler
        assert s.share is not None and s.share.path.exists()
        a, ka = await _runner(client, c_guest, gpu_weight=3)
        b, kb = await _runner(client, c_guest)
        for key in (ka, kb, ka):
            r = await client.post("/v1/functions/runner/invoke", content=ADD, headers=key)
            assert r.status_code == 200, r.text
            np.testing.assert_array_equal(np.frombuffer(r.content, dtype=np.float32), X + X)
        rows = {w.tenant_id: w.share_row for w in s.workers if w.tenant_id}
        assert set(rows) == {a, b} and len(set(rows.values())) == 2
        table = s.share.a
        for tid, weight in ((a, 3.0), (b, 1.0)):
            row = rows[tid]
            assert table["tenant"][row] == tenant_key(tid) and table["weight"][row] == weight
            assert table["busy"][row] == 0 and table["total"][row] > 0  # every period was settled
        metrics = (await client.get("/metrics")).text
        names = {w.tenant_id: w.tenant_name for w in s.workers if w.tenant_id}
        lines = [line for line in metrics.splitlines() if line.startswith("tensorwasm_gpu_seconds_total{")]
        assert {f'tenant="{names[a]}"' in line for line in lines} == {True, False} and all('device="0"' in line for line in lines)

        # a change of the tenant's quota replaces its worker: its row is cleared, its time kept
        before = s.gpu_time()[(names[a], 0)]
        r = await client.patch(f"/v1/admin/tenants/{a}/quota", json={"gpu_weight": 5}, headers=ADMIN)
        assert r.status_code == 200, r.text
        await until(lambda: a not in {w.tenant_id for w in s.workers}, "a's worker retired")
        assert table["tenant"][rows[a]] == 0 or rows[a] in {w.share_row for w in s.workers}
        assert s.gpu_time()[(names[a], 0)] == pytest.approx(before)
        assert (await client.post("/v1/functions/runner/invoke", content=ADD, headers=ka)).status_code == 200
        row = next(w.share_row for w in s.workers if w.tenant_id == a)
        assert table["weight"][row] == 5.0
        path = s.share.path
    assert not path.exists()  # the node's table goes with it


async def test_a_cpu_node_keeps_no_table(app_factory) -> None:
    async with app_factory(max_workers=2) as (_, platform):
        assert platform.scheduler.share is None


async def test_the_share_can_be_turned_off(app_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_module, "discover_devices", fake_gpus(1))
    async with app_factory(max_workers=2, gpu_share=False) as (_, platform):
        assert platform.scheduler.share is None


def test_the_weight_is_a_quota_field_with_bounds() -> None:
    from app.api.schemas import Quota, QuotaUpdate

    assert "gpu_weight" in Quota.model_fields
    with pytest.raises(ValueError):
        QuotaUpdate(gpu_weight=0)
    with pytest.raises(ValueError):
        QuotaUpdate(gpu_weight=101)
    assert ShareTable.__name__  # the table module imports without CUDA
