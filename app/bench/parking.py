"""`tensorwasm bench parking`: park an idle tenant's CUDA context off the GPU, or start a new worker?

The driver's process checkpoint (`cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock}`, driver
550+) moves a process's device memory to host memory and releases its context, and puts it back
later with its data intact. Parked contexts free GPU memory and do not count toward the driver's
context ceiling, so parking could keep more tenants warm than the ceiling allows; it is worth it
only if bringing a parked tenant back is faster than what the node does without it: a worker
forked from the fork server, bound to the tenant, serving its call. Both are measured here, on
the same node, in the same run (needs a GPU and the prebuilt `vector_add` guest or zig).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from app.bench.node import ADMIN, guest_wasm, server, setup_tenant


class _Driver:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._check(self.lib.cuInit(0), "cuInit")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUresult {rc}")

    def call(self, name: str, pid: int) -> float:
        t0 = time.perf_counter()
        self._check(getattr(self.lib, name)(ctypes.c_int(pid), None), name)
        return time.perf_counter() - t0


def _vector_add_wasm() -> bytes:
    return guest_wasm(Path(__file__).resolve().parents[2] / "examples" / "vector_add.c")


def _call(client: httpx.Client, headers: dict[str, str], body: bytes) -> float:
    t0 = time.perf_counter()
    r = client.post("/v1/functions/vadd/invoke", content=body, headers=headers)
    took = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"invoke: {r.status_code} {r.text[:300]}")
    return took


def _worker_pid(client: httpx.Client, tenant: str) -> int:
    workers = client.get("/v1/admin/workers", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    return next(int(w["pid"]) for w in workers if w["tenant"] == tenant)


def bench_parking(args: argparse.Namespace) -> int:
    wasm = _vector_add_wasm()
    body = np.arange(4096, dtype=np.float32).tobytes() * 2
    quota: dict[str, Any] = {"gpu_memory_bytes": 1 << 30, "requests_per_second": 1e5, "timeout_ms": 60_000}
    drv: _Driver | None = None
    res: dict[str, list[float]] = {"fork_start_bind_call_s": [], "warm_call_s": [], "checkpoint_s": [], "restore_s": [], "first_call_after_restore_s": []}
    # no warm spares: a new tenant's first call pays a fork-server start, the bind and the call
    backend = os.environ.get("TENSORWASM_BACKEND", "cuda")
    node = server("/healthz", TENSORWASM_BACKEND=backend, TENSORWASM_WARM_SPARES="0", TENSORWASM_MAX_WORKERS="16")
    with node as base, httpx.Client(base_url=base, timeout=120) as client:
        for i in range(args.rounds):
            name = f"park{i}"
            headers = setup_tenant(client, name, {"vadd": wasm}, **quota)
            res["fork_start_bind_call_s"].append(_call(client, headers, body))
            res["warm_call_s"].append(statistics.median(_call(client, headers, body) for _ in range(5)))
            pid = _worker_pid(client, name)
            drv = drv or _Driver()
            t_lock = drv.call("cuCheckpointProcessLock", pid)
            try:
                res["checkpoint_s"].append(t_lock + drv.call("cuCheckpointProcessCheckpoint", pid))
            except RuntimeError as exc:
                drv.call("cuCheckpointProcessUnlock", pid)
                memory = os.environ.get("TENSORWASM_GPU_MEMORY", "managed")
                print(f"the driver cannot park this worker (buffers in {memory} memory): {exc}")
                return 1
            t_restore = drv.call("cuCheckpointProcessRestore", pid)
            res["restore_s"].append(t_restore + drv.call("cuCheckpointProcessUnlock", pid))
            res["first_call_after_restore_s"].append(_call(client, headers, body))
    summary = {k: {"median_ms": statistics.median(v) * 1e3, "max_ms": max(v) * 1e3} for k, v in res.items()}
    print(json.dumps(summary, indent=2))
    park = summary["restore_s"]["median_ms"] + summary["first_call_after_restore_s"]["median_ms"]
    fresh = summary["fork_start_bind_call_s"]["median_ms"]
    print(f"\nrestore + first call: {park:.1f} ms; fork start + bind + first call: {fresh:.1f} ms; "
          f"parking {'wins' if park < fresh else 'does not win'} ({park / fresh:.2f}x)")
    return 0
