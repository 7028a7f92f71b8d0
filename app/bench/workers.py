"""`tensorwasm bench workers`: how fast workers start, forked from the fork server or as fresh
interpreters, one at a time and many at once, and what each costs in proportional RSS (PSS).

Both are measured in the same run on the same machine; on a GPU node each worker creates its CUDA
context, so the figures include the driver's own cost of a context.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from app.settings import Settings
from app.worker.client import WorkerHandle
from app.worker.forkserver import ForkServer


def _pss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _measure(backend: str, fork: bool, serial: int, parallel: list[int]) -> dict[str, Any]:
    settings = Settings(data_dir=Path(tempfile.mkdtemp(prefix="tw-bench-workers-")), backend=backend, admin_token="bench", worker_start_timeout_s=120)
    spawner = ForkServer(backend) if fork else None
    try:
        if spawner is not None:  # the fork server's own start is paid once per node, not per worker
            first = WorkerHandle(settings, spawner=spawner)
            await first.start()
            await first.close()
        res: dict[str, Any] = {"serial_s": []}
        for _ in range(serial):
            w = WorkerHandle(settings, spawner=spawner)
            t0 = time.perf_counter()
            await w.start()
            res["serial_s"].append(round(time.perf_counter() - t0, 3))
            await w.close()
        for n in parallel:
            ws = [WorkerHandle(settings, spawner=spawner) for _ in range(n)]
            t0 = time.perf_counter()
            await asyncio.gather(*(w.start() for w in ws))
            took = time.perf_counter() - t0
            res[f"{n}_at_once_per_s"] = round(n / took, 2)
            res[f"{n}_at_once_pss_mib"] = round(sum(_pss_mib(w.pid) for w in ws if w.pid) / n, 1)
            await asyncio.gather(*(w.close() for w in ws))
        return res
    finally:
        if spawner is not None:
            spawner.close_sync()


def bench_workers(args: argparse.Namespace) -> int:
    parallel = [int(n) for n in args.parallel.split(",") if n]
    out = {mode: asyncio.run(_measure(args.backend, mode == "fork", args.serial, parallel)) for mode in ("fresh", "fork")}
    print(json.dumps(out, indent=2))
    fresh, fork = out["fresh"], out["fork"]
    print(f"\none at a time: fork {min(fork['serial_s']):.3f}-{max(fork['serial_s']):.3f} s, fresh {min(fresh['serial_s']):.3f}-{max(fresh['serial_s']):.3f} s")
    for n in parallel:
        print(f"{n} at once: fork {fork[f'{n}_at_once_per_s']}/s ({fork[f'{n}_at_once_pss_mib']} MiB PSS each), "
              f"fresh {fresh[f'{n}_at_once_per_s']}/s ({fresh[f'{n}_at_once_pss_mib']} MiB)")
    return 0
