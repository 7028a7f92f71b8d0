"""Workers on every visible GPU, each pinned to its own (marked `gpu`: skipped without one).

With a low context ceiling (2 per device) the node stays quick on any number of GPUs; run on a
GPU machine with `pytest -m gpu tests/gpu/test_devices.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from app.gpu.probe import probe
from app.worker.handle import WorkerState
from tests.helpers import (
    ADMIN,
    deploy,
    make_settings,
    new_tenant,
    running_app,
    until,
    wat,
)

pytestmark = pytest.mark.gpu
CEILING = 2


async def test_workers_land_on_every_visible_device(database_url: str, tmp_path: Path) -> None:
    gpus = await probe()
    assert gpus, "the probe found no GPU on a GPU machine"
    n = len(gpus)
    settings = make_settings(
        database_url, tmp_path, backend="cuda", max_workers=CEILING * n, warm_spares=1,
        max_contexts_per_device=CEILING, worker_start_timeout_s=120, queue_wait_ms=5000,
    )
    async with running_app(settings) as (client, platform):
        s = platform.scheduler
        assert [d.index for d in s.devices.devices] == list(range(n))
        keys = []
        for _ in range(CEILING * n):
            _, key = await new_tenant(client, gpu_memory_bytes=64 << 20)
            assert (await deploy(client, key, "echo", wat("echo"))).status_code == 201
            keys.append(key)
        for key in keys:
            r = await client.post("/v1/functions/echo/invoke", content=b"hi", headers=key)
            assert r.status_code == 200 and r.content == b"hi", r.text
        await until(lambda: not any(w.state == WorkerState.STARTING for w in s.workers), "starts settled", 120)

        listed = (await client.get("/v1/admin/workers", headers=ADMIN)).json()
        assert {w["device"] for w in listed} == set(range(n)), listed
        for w in s.workers:  # inside each worker, device 0 is the physical GPU it was pinned to
            if w.state == WorkerState.DEAD:
                continue
            g = gpus[w.device_index]
            assert w.device.cuda_visible_devices == g.visible_id
            assert w.device.pci_bus_id == g.pci_bus_id, (w.device, g)
        ready = (await client.get("/readyz")).json()
        assert len(ready["devices"]) == n
        for d in ready["devices"]:
            assert d["contexts"] <= CEILING and d["ceiling"] == CEILING
            assert d["committed_bytes"] <= d["budget_bytes"] == gpus[d["index"]].total_memory_bytes
        metrics = (await client.get("/metrics")).text
        for i in range(n):
            assert f'tensorwasm_device_contexts{{device="{i}"}}' in metrics
