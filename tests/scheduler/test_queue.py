from __future__ import annotations

import asyncio

from tests.helpers import deploy, new_tenant


async def test_a_caller_that_leaves_the_queue_does_not_leak_its_slot(client, platform, c_guest) -> None:
    tid, key = await new_tenant(client, max_concurrency=1)
    await deploy(client, key, "spin", c_guest("spin.c"))
    assert (await client.post("/v1/functions/spin/invoke", content=b"1", headers=key)).status_code == 200
    running = asyncio.create_task(client.post("/v1/functions/spin/invoke", content=b"200", headers=key))
    await asyncio.sleep(0.05)
    queued = asyncio.create_task(client.post("/v1/functions/spin/invoke", content=b"1", headers=key))
    await asyncio.sleep(0.05)
    queued.cancel()  # the client disconnects while waiting for a slot
    assert (await running).status_code == 200
    ts = platform.scheduler.tenants[tid]
    assert ts.running == 0 and not ts.waiters
    # the slot is free again: the next call runs at once
    assert (await client.post("/v1/functions/spin/invoke", content=b"1", headers=key)).status_code == 200
