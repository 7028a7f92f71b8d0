"""`tensorwasm bench workers`: how fast workers start, forked from the fork server or as fresh
interpreters, one at a time and many at once, and what each costs in proportional RSS (PSS).

Both are measured in the same run on the same machine; on a GPU node each worker creates its CUDA
context, so the figures include the driver's own cost of a context.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from app.settings import Settings
from app.worker.forkserver import ForkServer
from app.worker.handle import WorkerHandle


def _pss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _measure(
    backend: Literal["auto", "cpu", "cuda"], fork: bool, serial: int, parallel: list[int], each: bool = False, devices: list[str] | None = None,
    held: int = 0,
) -> dict[str, Any]:
    """`devices`: CUDA_VISIBLE_DEVICES entries the workers of a batch are spread over, in turn
    (None: not pinned) - whether the driver serializes context creation per device or per host.
    `held`: workers started first and kept alive through the batches (a device holding that many
    contexts already, as a full node's does)."""
    settings = Settings(data_dir=Path(tempfile.mkdtemp(prefix="tw-bench-workers-")), backend=backend, admin_token="bench", worker_start_timeout_s=120)
    spawner = ForkServer(backend) if fork else None
    kept: list[WorkerHandle] = []
    try:
        if spawner is not None:  # the fork server's own start is paid once per node, not per worker
            first = WorkerHandle(settings, spawner=spawner)
            await first.start()
            await first.close()
        for i in range(0, held, 16):
            batch = [WorkerHandle(settings, spawner=spawner) for _ in range(min(16, held - i))]
            kept += batch
            await asyncio.gather(*(w.start() for w in batch))
        res: dict[str, Any] = {"serial_s": []}
        for _ in range(serial):
            w = WorkerHandle(settings, spawner=spawner)
            t0 = time.perf_counter()
            await w.start()
            res["serial_s"].append(round(time.perf_counter() - t0, 3))
            await w.close()
        for n in parallel:
            ws = [WorkerHandle(settings, spawner=spawner, visible_device=devices[i % len(devices)] if devices else None) for i in range(n)]
            t0 = time.perf_counter()
            await asyncio.gather(*(w.start() for w in ws))
            took = time.perf_counter() - t0
            res[f"{n}_at_once_per_s"] = round(n / took, 2)
            if each:  # every batch of a size, not only the last
                res.setdefault(f"{n}_at_once_per_s_each", []).append(n / took)
            res[f"{n}_at_once_pss_mib"] = round(sum(_pss_mib(w.pid) for w in ws if w.pid) / n, 1)
            t0 = time.perf_counter()  # killed at once, gone once the driver tore their contexts down
            await asyncio.gather(*(w.close() for w in ws))
            res[f"{n}_at_once_ended_per_s"] = round(n / (time.perf_counter() - t0), 2)
        return res
    finally:
        await asyncio.gather(*(w.close() for w in kept))
        if spawner is not None:
            spawner.close_sync()


async def fork_starts_per_s(backend: Literal["auto", "cpu", "cuda"], n: int, batches: int = 3, held: int = 0) -> float:
    """Workers forked from a warm fork server, `n` at once, `batches` times, beside `held` live
    ones: the median of the batches' starts per second (on a GPU node each creates its context:
    the driver's cost is in)."""
    res = await _measure(backend, True, 0, [n] * batches, each=True, held=held)
    return float(statistics.median(res[f"{n}_at_once_per_s_each"]))


def bench_workers(args: argparse.Namespace) -> int:
    parallel = [int(n) for n in args.parallel.split(",") if n]
    devices = [d for d in (args.devices or "").split(",") if d] or None
    modes = ("fork",) if args.fork_only else ("fresh", "fork")
    out = {mode: asyncio.run(_measure(args.backend, mode == "fork", args.serial, parallel, devices=devices)) for mode in modes}
    print(json.dumps(out, indent=2))
    fork = out["fork"]
    print(f"\nworkers spread over CUDA_VISIBLE_DEVICES {devices or 'as inherited'}")
    for mode, res in out.items():
        if res["serial_s"]:
            print(f"one at a time, {mode}: {min(res['serial_s']):.3f}-{max(res['serial_s']):.3f} s")
    for n in parallel:
        fresh = f", fresh {out['fresh'][f'{n}_at_once_per_s']}/s ({out['fresh'][f'{n}_at_once_pss_mib']} MiB)" if "fresh" in out else ""
        print(f"{n} at once: fork {fork[f'{n}_at_once_per_s']}/s started, {fork[f'{n}_at_once_ended_per_s']}/s ended "
              f"({fork[f'{n}_at_once_pss_mib']} MiB PSS each){fresh}")
    return 0
