"""The api process's handle on one worker process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import StrEnum
from typing import Any

from app.settings import Settings
from app.worker.forkserver import ForkedProcess, ForkServer
from app.worker.protocol import encode, read_frame_async
from app.worker.stats import StatsPage, page_path, stats_dir

log = logging.getLogger(__name__)


class WorkerState(StrEnum):
    STARTING = "starting"  # process started, not ready yet
    SPARE = "spare"  # ready, bound to no tenant
    BINDING = "binding"  # being bound to a tenant for a call
    IDLE = "idle"  # bound, nothing running
    BUSY = "busy"  # bound, running a call
    DEAD = "dead"  # killed or exited; never reused


class WorkerLost(RuntimeError):
    """The worker died or its pipe broke while we talked to it."""


@dataclass
class WorkerHandle:
    settings: Settings
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    state: WorkerState = WorkerState.STARTING
    backend: str = "unknown"
    device: dict[str, Any] = field(default_factory=dict)
    tenant_id: str | None = None
    tenant_name: str | None = None
    gpu_cap: int = 0
    kernels_version: int = -1
    invocations: int = 0
    last_used: float = field(default_factory=time.monotonic)
    started_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    retire_reason: str | None = None
    proc: asyncio.subprocess.Process | ForkedProcess | None = None
    spawner: ForkServer | None = None  # None: a fresh interpreter per worker
    stats: StatsPage | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def start(self) -> None:
        s = self.settings
        stats_path = page_path(stats_dir(s.data_dir), self.id)
        self.stats = StatsPage(stats_path, create=True)
        argv = [
            "--backend", s.backend,
            "--cache-dir", str(s.cache_dir.resolve()),
            "--stats", str(stats_path),
            "--tick-ms", str(s.epoch_tick_ms),
            "--max-buffers", str(s.max_buffers_per_instance),
            "--max-modules", str(s.max_modules_per_instance),
            "--gpu-memory", s.gpu_memory,
            "--pin-budget", str(s.pinned_guest_memory_bytes),
        ]
        if self.spawner is not None:  # the fork server makes its children die with it
            self.proc = await self.spawner.spawn(argv, limit=1 << 20)
        else:
            # the worker dies with this process; spawned from the event loop's thread, which
            # lives as long as the process (the parent-death signal follows the thread)
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "app.worker.main", *argv, "--parent-pid", str(os.getpid()),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 20,
            )
        header, _ = await asyncio.wait_for(self._read(), timeout=s.worker_start_timeout_s)
        if header.get("op") != "ready":
            raise WorkerLost(f"worker {self.id} sent {header.get('op')!r} instead of ready")
        self.backend = header["backend"]
        self.device = header.get("device", {})
        self.state = WorkerState.SPARE

    async def _read(self) -> tuple[dict[str, Any], bytes]:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            return await read_frame_async(self.proc.stdout)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise WorkerLost(f"worker {self.id} exited (code {self.proc.returncode})") from exc

    async def request(self, header: dict[str, Any], body: bytes = b"") -> tuple[dict[str, Any], bytes]:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.writelines(encode(header, body))
            await self.proc.stdin.drain()
        except (ConnectionError, RuntimeError) as exc:
            raise WorkerLost(f"worker {self.id} is gone") from exc
        return await self._read()

    async def bind(self, tenant_id: str, tenant_name: str, gpu_cap: int, kernels: dict[str, str], kernels_version: int) -> None:
        header, _ = await self.request(
            {"op": "bind", "tenant_id": tenant_id, "tenant": tenant_name, "gpu_memory_bytes": gpu_cap, "kernels": kernels}
        )
        if header.get("op") != "ok":
            raise WorkerLost(f"worker {self.id} refused bind: {header}")
        self.tenant_id, self.tenant_name, self.gpu_cap = tenant_id, tenant_name, gpu_cap
        self.kernels_version = kernels_version

    def live_stats(self) -> dict[str, int]:
        return self.stats.read() if self.stats else {}

    def kill(self) -> None:
        self.state = WorkerState.DEAD
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    async def close(self) -> None:
        self.kill()
        if self.proc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.proc.wait(), timeout=5)
        if self.stats is not None:
            self.stats.close(unlink=True)
            self.stats = None
