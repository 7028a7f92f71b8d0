"""The supervisor's handle on one worker process (in a one-process node, the api process's)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum

from app.contract.frames import Payload, ProtocolError, encode, read_frame_async
from app.contract.messages import Bind, Chunk, DeviceInfo, Done, Ready, StartRefusal, WorkerMessage
from app.observability.phases import SEND, clock, lap
from app.runtime.environment import tenant_process_env
from app.settings import Settings
from app.worker.forkserver import ForkedProcess, ForkServer
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


class StartRefused(WorkerLost):
    """The driver refused the worker's device context (the device's context ceiling)."""


@dataclass
class WorkerHandle:
    settings: Settings
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    state: WorkerState = WorkerState.STARTING
    backend: str = "unknown"
    device: DeviceInfo = field(default_factory=DeviceInfo)  # as the worker reports it (its device 0)
    device_index: int = 0  # the node's device it is pinned to (app/scheduler/devices.py)
    # CUDA_VISIBLE_DEVICES of the worker: the one GPU it may see; None: inherit the node's (CPU)
    visible_device: str | None = None
    tenant_id: str | None = None
    tenant_name: str | None = None
    gpu_cap: int = 0
    kernels_version: str = ""  # content hash of the kernel sources the worker holds
    invocations: int = 0
    last_used: float = field(default_factory=time.monotonic)
    bound_at: float = 0.0  # monotonic time of its binding to its tenant
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    retire_reason: str | None = None
    proc: asyncio.subprocess.Process | ForkedProcess | None = None
    spawner: ForkServer | None = None  # None: a fresh interpreter per worker
    stats: StatsPage | None = None
    socket_path: str | None = None  # where fronts send leased runs (a node of several fronts)
    slot: int = -1  # its queue's place in the node's admission table (a node of several fronts)
    share_row: int = -1  # its row in the node's GPU share table (app/gpu/share.py); -1: none

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
            # the worker dies with this process (its watchdog watches this pid); spawned from the
            # event loop's thread, which lives as long as the process, as the parent-death
            # signal follows the thread that forked
            "--node-pid", str(os.getpid()),
            "--tick-ms", str(s.epoch_tick_ms),
            "--max-buffers", str(s.max_buffers_per_instance),
            "--max-modules", str(s.max_modules_per_instance),
            "--gpu-memory", s.gpu_memory,
            "--pin-budget", str(s.pinned_guest_memory_bytes),
            "--spin-us", str(s.spin_us),
        ]
        if self.socket_path is not None:
            argv += ["--socket", self.socket_path]
        env = {"CUDA_DEVICE_MAX_CONNECTIONS": str(s.cuda_max_connections)}
        if self.visible_device is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.visible_device
        if self.spawner is not None:  # the fork server makes its children die with it
            self.proc = await self.spawner.spawn(argv, env=env, limit=1 << 20)
        else:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "app.worker.main", *argv,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 20, start_new_session=True,
                env=tenant_process_env(env),  # no secret of the node (app/runtime/environment.py)
            )
        header, _ = await asyncio.wait_for(self._read(), timeout=s.worker_start_timeout_s)
        if isinstance(header, StartRefusal):
            raise StartRefused(f"worker {self.id}: the driver refused its context: {header.error}")
        if not isinstance(header, Ready):
            raise WorkerLost(f"worker {self.id} sent {type(header).__name__} instead of ready")
        self.backend = header.backend
        self.device = header.device
        self.state = WorkerState.SPARE

    async def _read(self) -> tuple[WorkerMessage, Payload]:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            return await read_frame_async(self.proc.stdout)
        except (asyncio.IncompleteReadError, ConnectionError, ProtocolError) as exc:
            raise WorkerLost(f"worker {self.id} exited (code {self.proc.returncode})") from exc

    async def request(
        self, header: WorkerMessage, body: bytes = b"", on_chunk: Callable[[Payload], None] | None = None
    ) -> tuple[WorkerMessage, Payload]:
        """Send one request and return its reply; `Chunk` frames before it go to `on_chunk`."""
        assert self.proc is not None and self.proc.stdin is not None
        try:
            t = clock()
            self.proc.stdin.writelines(encode(header, body))
            lap(SEND, t)  # a call's run in a one-process node (a supervisor publishes no phases)
            await self.proc.stdin.drain()
        except (ConnectionError, RuntimeError) as exc:
            raise WorkerLost(f"worker {self.id} is gone") from exc
        if on_chunk is None:
            return await self._read()
        while True:
            reply, data = await self._read()
            if not isinstance(reply, Chunk):
                return reply, data
            on_chunk(data)

    async def bind(
        self, tenant_id: str, tenant_name: str, gpu_cap: int, secret: bytes = b"", share_path: str = "", gpu_weight: int = 1,
        warm: bool = False,
    ) -> None:
        """Bind to a tenant with no kernels: the first run carries the tenant's current set.
        `share_path`: the node's GPU share table, where the worker's `share_row` is bound;
        `warm`: the tenant's calls have used the backend's deferred set-up (`Bind.warm`)."""
        header, _ = await self.request(
            Bind(
                tenant_id=tenant_id, tenant=tenant_name, gpu_memory_bytes=gpu_cap, worker_id=self.id, secret=secret,
                share_path=share_path if self.share_row >= 0 else "", share_row=self.share_row, device=self.device_index,
                gpu_weight=gpu_weight, warm=warm,
            )
        )
        if not isinstance(header, Done):
            raise WorkerLost(f"worker {self.id} refused bind: {header}")
        self.tenant_id, self.tenant_name, self.gpu_cap = tenant_id, tenant_name, gpu_cap
        self.kernels_version = ""

    def live_stats(self) -> dict[str, int]:
        return self.stats.read() if self.stats else {}

    def used_deferred(self) -> bool:
        """A call on this worker has used the backend's deferred set-up (its page says so)."""
        return self.stats is not None and self.stats.get("deferred_used") != 0

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
