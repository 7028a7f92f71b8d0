"""GPU time per tenant: on a real CUDA node, tenant H keeps several calls in flight of a
kernel that holds every SM for 10 ms, beside tenant V calling the same kernel one call at a time.
The share of each device's GPU time, read from `tensorwasm_gpu_seconds_total`, follows the
tenants' `gpu_weight`s and not the number of their contexts. Marked `gpu`: skipped without one.

Why V spins too: a tenant at c=1 leaves the device idle between its calls (HTTP, instantiation,
copies); a small std-kernel guest uses the device for a few percent of its call, so under any
policy that gives unused time away its GPU seconds would be tiny and the ratio would say nothing.
A V that spins asks for the whole device while it calls, so the ratio shows the policy. Without
it the driver slices time between contexts, and H's 3 contexts take ~3/4 of it (H/V near 3 or
more); with the weights 1:1, H/V stays near 1 (bound: 1.6, as V's gaps between calls go to H);
with V's weight 3 to H's 1, near 1/3 (bound: 0.7).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.bench import gpu_share as gs
from app.bench.gpu_share import Load, Tenant
from tests.helpers import ADMIN, ADMIN_TOKEN, deploy, new_tenant, server_process

pytestmark = pytest.mark.gpu

SPIN_MS = 10
SECONDS, SETTLE_S = 3.0, 1.0
EQUAL_BOUND, WEIGHTED_BOUND = 1.6, 0.7  # H's GPU seconds over V's on a device they share
VICTIM_WEIGHT = 3


def _node_env(devices: list[str], heavy: int, victims: int) -> dict[str, str | None]:
    return {
        "TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN, "TENSORWASM_BACKEND": "cuda", "TENSORWASM_WORKER_START_TIMEOUT_S": "120",
        "TENSORWASM_QUEUE_WAIT_MS": "30000", "TENSORWASM_WARM_SPARES": "2",
        # H's and the victims' workers, the slot kept for a tenant with nothing running, two spares
        "TENSORWASM_MAX_WORKERS": str(heavy + victims + 3), "CUDA_VISIBLE_DEVICES": ",".join(devices),
    }


async def _tenant(client: httpx.AsyncClient, label: str, wasm: bytes, concurrency: int) -> Tenant:
    tid, key = await new_tenant(client, **gs.quota(concurrency))
    r = await deploy(client, key, gs.FUNCTION, wasm)
    assert r.status_code == 201, r.text
    r = await client.get(f"/v1/admin/tenants/{tid}", headers=ADMIN)
    assert r.status_code == 200, r.text
    return Tenant(label, tid, r.json()["name"], key)


def _victim_devices(where: dict[str, list[int]], victims: list[str]) -> list[int]:
    """The device of each victim's worker (-1: it holds none)."""
    return sorted(where[v][0] if where[v] else -1 for v in victims)


def _shares(phase: dict[str, Any], where: dict[str, list[int]], victims: list[str]) -> dict[int, tuple[float, float]]:
    """Per device of a victim: (H's GPU seconds there, that victim's)."""
    gpu = phase["gpu_seconds"]
    assert gpu is not None, f"no {gs.GPU_SECONDS} on the node's /metrics"
    out = {}
    for v in victims:
        d = where[v][0]  # one each (checked)
        out[d] = (gpu["H"].get(str(d), 0.0), gpu[v].get(str(d), 0.0))
    return out


async def _run(tmp_path: Path, database_url: str, c_guest: Callable[[str], bytes], n_devices: int, heavy: int) -> None:
    devices = gs.visible_entries(n_devices)
    sms = gs.device_sms(",".join(devices))
    if len(sms) < n_devices:
        pytest.skip(f"needs {n_devices} visible GPUs; CUDA_VISIBLE_DEVICES={','.join(devices)} shows {len(sms)}")
    blocks = min(sms) * 4
    body = gs.spin_request(SPIN_MS, blocks)
    victims = [f"V{i}" for i in range(n_devices)]
    with server_process(tmp_path / "node", database_url, env=_node_env(devices, heavy, n_devices)) as server:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            wasm = c_guest("kernel_runner.c")
            h = await _tenant(client, "H", wasm, heavy + 2)
            vs = [await _tenant(client, label, wasm, 2) for label in victims]
            tenants = [h, *vs]
            gs.check_spin(await gs.invoke(client, vs[0], body), SPIN_MS, blocks)  # the kernel spins as it says
            loads = [Load(h, body, heavy), *(Load(v, body, 1) for v in vs)]

            async def warm() -> dict[str, list[int]]:
                # victims first, one after another: each binds a spare on the device with the most
                # budget left, so on two devices they take one each, and H's workers go to both
                for v in vs:
                    await gs.warm(client, [Load(v, body, 1)], tenants, ADMIN_TOKEN, min_rounds=1)
                return await gs.warm(client, loads, tenants, ADMIN_TOKEN)

            where = await warm()
            assert len(where["H"]) >= heavy, f"H holds {len(where['H'])} workers, not {heavy}: {where}"
            assert _victim_devices(where, victims) == list(range(n_devices)), f"a victim per device: {where}"
            assert set(where["H"]) == set(range(n_devices)), f"H's workers on every device: {where}"

            equal = await gs.measure(client, loads, tenants, SECONDS, SETTLE_S, ADMIN_TOKEN)
            for v in vs:
                await gs.set_weight(client, v, VICTIM_WEIGHT, ADMIN_TOKEN)
            await gs.set_weight(client, h, 1, ADMIN_TOKEN)
            where_w = await warm()  # a quota change may rebind workers
            assert _victim_devices(where_w, victims) == list(range(n_devices)) and set(where_w["H"]) == set(range(n_devices)), where_w
            weighted = await gs.measure(client, loads, tenants, SECONDS, SETTLE_S, ADMIN_TOKEN)

    said = f"1:1 {equal}\n3:1 {weighted}\nworkers {where} then {where_w}"
    for name, phase, at, bound in (("1:1", equal, where, EQUAL_BOUND), (f"{VICTIM_WEIGHT}:1", weighted, where_w, WEIGHTED_BOUND)):
        assert all(phase["tenants"][t.label]["calls"] > 0 for t in tenants), f"{name}: every tenant made progress\n{said}"
        for d, (h_s, v_s) in _shares(phase, at, victims).items():
            assert v_s > 0 and h_s > 0, f"{name}, device {d}: both tenants were charged GPU time\n{said}"
            assert h_s <= bound * v_s, f"{name}, device {d}: H {h_s:.2f} s against V {v_s:.2f} s (bound {bound}x)\n{said}"


async def test_gpu_time_follows_the_weights_on_one_device(server_database_url: str, tmp_path: Path, c_guest: Callable[[str], bytes]) -> None:
    await _run(tmp_path, server_database_url, c_guest, n_devices=1, heavy=3)


async def test_gpu_time_follows_the_weights_on_each_of_two_devices(server_database_url: str, tmp_path: Path, c_guest: Callable[[str], bytes]) -> None:
    # H with two calls in flight per device, a victim on each
    await _run(tmp_path, server_database_url, c_guest, n_devices=2, heavy=4)
