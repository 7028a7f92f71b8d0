"""Workers forked from the fork server: they run, their exits are seen, and none outlives it."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from app.worker.client import WorkerHandle
from app.worker.forkserver import ForkServer
from tests.helpers import make_settings, process_alive


async def _gone(pid: int, within_s: float = 5.0) -> bool:
    for _ in range(int(within_s / 0.05)):
        if not process_alive(pid):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_forked_workers_serve_and_their_exit_is_seen(tmp_path: Path) -> None:
    settings = make_settings("sqlite://", tmp_path)
    fs = ForkServer("cpu")
    try:
        a, b = WorkerHandle(settings, spawner=fs), WorkerHandle(settings, spawner=fs)
        await asyncio.gather(a.start(), b.start())
        assert a.backend == b.backend == "cpu" and a.pid != b.pid
        assert os.getppid() != a.pid and fs.pid is not None
        with open(f"/proc/{a.pid}/stat") as f:  # the fork server is the worker's parent
            assert int(f.read().split(") ", 1)[1].split()[1]) == fs.pid
        reply, _ = await a.request({"op": "ping"})
        assert reply["op"] == "pong"
        a.proc.kill()  # type: ignore[union-attr]
        assert await asyncio.wait_for(a.proc.wait(), 5) == -signal.SIGKILL  # type: ignore[union-attr]
        reply, _ = await b.request({"op": "ping"})  # the other one is untouched
        assert reply["op"] == "pong"
        await asyncio.gather(a.close(), b.close())
    finally:
        fs.close_sync()


async def test_workers_die_with_the_fork_server_and_it_comes_back(tmp_path: Path) -> None:
    settings = make_settings("sqlite://", tmp_path)
    fs = ForkServer("cpu")
    try:
        w = WorkerHandle(settings, spawner=fs)
        await w.start()
        server_pid = fs.pid
        assert server_pid is not None
        os.kill(server_pid, signal.SIGKILL)
        assert await _gone(w.pid), "a worker outlived its fork server"  # type: ignore[arg-type]
        await w.close()
        again = WorkerHandle(settings, spawner=fs)  # the next spawn starts a new fork server
        await again.start()
        assert fs.pid != server_pid
        assert (await again.request({"op": "ping"}))[0]["op"] == "pong"
        await again.close()
    finally:
        fs.close_sync()
