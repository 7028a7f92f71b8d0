"""GPU admission: a binding is admitted only while bound caps plus per-context overhead fit the
device; otherwise idle tenants are evicted, and a cap that can never fit is refused."""

from __future__ import annotations

from tests.helpers import deploy, new_tenant, wat

MIB = 1 << 20


async def test_admission_evicts_idle_tenants_to_fit_the_device(app_factory) -> None:
    # budget: 3 contexts of 100 MiB overhead + one 500 MiB cap; a second bound tenant cannot fit
    async with app_factory(max_workers=3, warm_spares=1, context_overhead_bytes=100 * MIB, device_memory_bytes=800 * MIB) as (client, platform):
        s = platform.scheduler
        s.devices[0].budget_bytes = 800 * MIB  # exercise the GPU admission rule with CPU workers
        _, a = await new_tenant(client, gpu_memory_bytes=500 * MIB)
        _, b = await new_tenant(client, gpu_memory_bytes=500 * MIB)
        for key in (a, b):
            await deploy(client, key, "echo", wat("echo"))
        assert (await client.post("/v1/functions/echo/invoke", content=b"a", headers=a)).content == b"a"
        evicted = s.restarts["evicted"]
        r = await client.post("/v1/functions/echo/invoke", content=b"b", headers=b)
        assert r.content == b"b", r.text
        assert s.restarts["evicted"] == evicted + 1, "tenant a's idle context had to go to admit b"
        assert s.committed_bytes() <= s.devices[0].budget_bytes
        bound = {w.tenant_id for w in s.workers if w.tenant_id}
        assert len(bound) == 1


async def test_a_cap_larger_than_the_device_is_refused(app_factory) -> None:
    async with app_factory(context_overhead_bytes=100 * MIB, device_memory_bytes=800 * MIB) as (client, platform):
        platform.scheduler.devices[0].budget_bytes = 800 * MIB
        _, key = await new_tenant(client, gpu_memory_bytes=750 * MIB)
        await deploy(client, key, "echo", wat("echo"))
        r = await client.post("/v1/functions/echo/invoke", content=b"x", headers=key)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_capacity"
        assert r.headers["retry-after"] == "1"
