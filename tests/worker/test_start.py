"""A worker's start as the node sees it: pinned to its device through its environment, and a
context the driver refused told apart from a crash."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from app.gpu.cuda import is_refusal
from app.worker.handle import StartRefused, WorkerHandle, WorkerLost, WorkerState
from tests.helpers import checkout_pythonpath, make_settings

# Stand-ins for app.worker.main: each answers its first frame as a worker would at start.
REFUSED = (
    "import sys; from app.contract.frames import write_frame; from app.contract.messages import StartRefusal; "
    "write_frame(sys.stdout.buffer, StartRefusal(error='cudaErrorMemoryAllocation'))"
)
READY = (
    "import os, sys; from app.contract.frames import write_frame; from app.contract.messages import DeviceInfo, Ready; "
    "write_frame(sys.stdout.buffer, Ready(pid=os.getpid(), backend='cpu', device=DeviceInfo(cuda_visible_devices=os.environ.get('CUDA_VISIBLE_DEVICES')))); "
    "sys.stdin.read()"
)
CRASH = "import sys; sys.exit(1)"


class ScriptSpawner:
    """Spawns a short Python script in place of a worker, with the environment it was given."""

    def __init__(self, script: str) -> None:
        self.script = script

    async def spawn(self, argv: list[str], env: dict[str, str] | None = None, limit: int = 1 << 20) -> Any:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-c", self.script, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": checkout_pythonpath(), **(env or {})}, limit=limit,
        )


def handle(tmp_path: Path, script: str, visible: str | None) -> WorkerHandle:
    settings = make_settings(f"sqlite:///{tmp_path / 'unused.db'}", tmp_path, worker_start_timeout_s=30)
    return WorkerHandle(settings, spawner=ScriptSpawner(script), device_index=1, visible_device=visible)  # type: ignore[arg-type]


async def test_a_worker_sees_only_the_device_it_is_pinned_to(tmp_path: Path) -> None:
    w = handle(tmp_path, READY, "3")
    try:
        await w.start()
        assert w.state == WorkerState.SPARE and w.device.cuda_visible_devices == "3"
    finally:
        await w.close()


async def test_a_refused_context_is_not_a_crash(tmp_path: Path) -> None:
    w = handle(tmp_path, REFUSED, "0")
    with pytest.raises(StartRefused, match="cudaErrorMemoryAllocation"):
        await w.start()
    await w.close()
    crashed = handle(tmp_path, CRASH, "0")
    with pytest.raises(WorkerLost) as info:
        await crashed.start()
    assert not isinstance(info.value, StartRefused)
    await crashed.close()


class _RuntimeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def test_which_cuda_errors_are_refusals() -> None:
    assert is_refusal(_RuntimeError(2, "cudaErrorMemoryAllocation: out of memory"))
    assert is_refusal(_RuntimeError(46, "cudaErrorDevicesUnavailable: CUDA-capable device(s) is/are busy or unavailable"))
    assert is_refusal(RuntimeError("CUDA_ERROR_OUT_OF_MEMORY: out of memory"))
    assert not is_refusal(_RuntimeError(100, "cudaErrorNoDevice: no CUDA-capable device is detected"))
    assert not is_refusal(_RuntimeError(35, "cudaErrorInsufficientDriver"))
