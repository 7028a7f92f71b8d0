"""Workers forked from the fork server: they run, their exits are seen, and none outlives it."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
from pathlib import Path
from typing import Any, ClassVar

import pytest

from app.contract.messages import Ping, Pong
from app.worker.forkserver import ForkServer
from app.worker.handle import WorkerHandle
from tests.helpers import make_settings, process_alive


async def _gone(pid: int, within_s: float = 5.0) -> bool:
    for _ in range(int(within_s / 0.05)):
        if not process_alive(pid):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_forked_workers_serve_and_their_exit_is_seen(tmp_path: Path) -> None:
    settings = make_settings("sqlite://", tmp_path, backend="cpu")  # the fork server below is a CPU one
    fs = ForkServer("cpu")
    try:
        a, b = WorkerHandle(settings, spawner=fs), WorkerHandle(settings, spawner=fs)
        await asyncio.gather(a.start(), b.start())
        assert a.backend == b.backend == "cpu" and a.pid != b.pid
        assert os.getppid() != a.pid and fs.pid is not None
        with open(f"/proc/{a.pid}/stat") as f:  # the fork server is the worker's parent
            assert int(f.read().split(") ", 1)[1].split()[1]) == fs.pid
        reply, _ = await a.request(Ping())
        assert isinstance(reply, Pong)
        a.proc.kill()  # type: ignore[union-attr]
        assert await asyncio.wait_for(a.proc.wait(), 5) == -signal.SIGKILL  # type: ignore[union-attr]
        reply, _ = await b.request(Ping())  # the other one is untouched
        assert isinstance(reply, Pong)
        await asyncio.gather(a.close(), b.close())
    finally:
        fs.close_sync()


async def test_workers_die_with_the_fork_server_and_it_comes_back(tmp_path: Path) -> None:
    settings = make_settings("sqlite://", tmp_path, backend="cpu")  # the fork server below is a CPU one
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
        assert isinstance((await again.request(Ping()))[0], Pong)
        await again.close()
    finally:
        fs.close_sync()


class _Probe(io.FileIO):
    """A pipe's file object that, when closed, first takes the lowest free fds (as another thread
    opening a pipe would) and then checks its own close left them open."""

    stolen: ClassVar[list[int]] = []

    def close(self) -> None:
        if not self.closed:
            r, w = os.pipe()
            try:
                super().close()
                for fd in (r, w):
                    try:
                        os.fstat(fd)
                    except OSError:
                        _Probe.stolen.append(fd)
            finally:
                for fd in (r, w):
                    with contextlib.suppress(OSError):
                        os.close(fd)
        else:
            super().close()


_fdopen = os.fdopen


def _probe_fdopen(fd: int, mode: str = "r", buffering: int = -1, closefd: bool = True) -> Any:
    if buffering != 0:  # not a worker's pipe (the stats page)
        return _fdopen(fd, mode, buffering, closefd=closefd)
    return _Probe(fd, mode.replace("b", ""), closefd=closefd)


def test_closing_a_worker_under_uvloop_closes_no_other_fd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn runs the node on uvloop, whose pipe transports close the fd in libuv and then the
    file object too: the second close must not take an fd opened in between."""
    import uvloop

    settings = make_settings("sqlite://", tmp_path, backend="cpu")  # the fork server below is a CPU one
    monkeypatch.setattr(os, "fdopen", _probe_fdopen)
    _Probe.stolen = []

    async def main() -> None:
        fs = ForkServer("cpu")
        try:
            w = WorkerHandle(settings, spawner=fs)
            await w.start()
            assert isinstance((await w.request(Ping()))[0], Pong)
            w.proc.stdin.close()  # type: ignore[union-attr]
            await w.close()
            await asyncio.sleep(0.2)  # the loop closes both pipes
        finally:
            fs.close_sync()

    uvloop.run(main())
    assert _Probe.stolen == []
