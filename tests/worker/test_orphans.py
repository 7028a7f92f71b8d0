"""Killing a node with SIGKILL in the middle of a guest leaves no worker running and, once the
next node on the host starts, no stats page."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from app.worker.stats import stats_dir
from tests.helpers import ADMIN, ADMIN_TOKEN, deploy, descendants, make_settings, new_tenant, process_alive, running_app, server_process, wat


async def test_sigkill_of_the_node_mid_guest_leaves_no_process_and_no_page(server_database_url, tmp_path) -> None:
    with server_process(tmp_path / "node", server_database_url, env={"TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN}) as server:
        proc = server.proc
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            _, key = await new_tenant(http, timeout_ms=600_000)
            assert (await deploy(http, key, "loop", wat("loop"))).status_code == 201
            call = asyncio.create_task(http.post("/v1/functions/loop/invoke", headers=key))
            deadline = time.monotonic() + 120
            while True:
                workers = (await http.get("/v1/admin/workers", headers=ADMIN)).json()
                states = [w["state"] for w in workers]
                # settled: the busy worker and the spare started to replace it (max_workers 2)
                if "busy" in states and len(states) == 2 and "starting" not in states and "binding" not in states:
                    break
                assert time.monotonic() < deadline, f"the guest never started: {workers}"
                await asyncio.sleep(0.05)
            tree = descendants(proc.pid)
            pids = [w["pid"] for w in workers]
            assert set(pids) <= tree
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            with pytest.raises(httpx.HTTPError):
                await call
    deadline = time.monotonic() + 10  # a liveness bound, not a measurement
    while left := [p for p in tree if process_alive(p)]:
        assert time.monotonic() < deadline, f"processes {left} outlived the node"
        await asyncio.sleep(0.05)

    shm = stats_dir(tmp_path)
    pages = list(shm.glob(f"tensorwasm-worker-{proc.pid}.*"))
    assert len(pages) == len(pids)  # the killed node could not remove them itself
    async with running_app(make_settings(server_database_url, tmp_path / "next")):
        assert not [p for p in pages if p.exists()]  # swept as the next node started
