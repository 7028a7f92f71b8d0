"""Worker process: one device context, one bound tenant, one guest at a time.

Started by the api process as a fresh interpreter (`python -m app.worker.main`), never forked
from it, so a CUDA context is always created in a clean process. It speaks the protocol of
app/worker/protocol.py over its stdin/stdout; its own prints go to stderr. It dies with the
process that started it (app/worker/lifeline.py), even in the middle of a guest.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from app.worker.protocol import read_frame, write_frame


def _make_backend(kind: str, cache_dir: Path, memory_kind: str) -> Any:
    from app.gpu.cpu import CpuBackend

    if kind in ("cuda", "auto"):
        from app.gpu.cuda import CudaBackend, cuda_available

        if kind == "cuda" or cuda_available():
            return CudaBackend(cache_dir, memory_kind)
    return CpuBackend()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--stats", required=True)
    ap.add_argument("--tick-ms", type=int, default=5)
    ap.add_argument("--max-buffers", type=int, default=1024)
    ap.add_argument("--max-modules", type=int, default=64)
    ap.add_argument("--gpu-memory", default="managed", choices=("managed", "device"))
    ap.add_argument("--pin-budget", type=int, default=0)
    ap.add_argument("--parent-pid", type=int, default=None, help="die when this process is gone")
    args = ap.parse_args(argv)
    if args.parent_pid is not None:
        from app.worker.lifeline import die_with_parent

        die_with_parent(args.parent_pid)  # first: before the seconds spent importing the runtime

    # Keep the protocol on private descriptors; anything printed lands on stderr instead.
    proto_in = os.fdopen(os.dup(0), "rb", buffering=1 << 16)
    proto_out = os.fdopen(os.dup(1), "wb", buffering=1 << 16)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="worker %(process)d %(levelname)s %(message)s")

    from app.gpu.abi import AbiHost
    from app.runtime.artifacts import ArtifactCache
    from app.runtime.engine import make_engine
    from app.runtime.memory import GuestMemory
    from app.runtime.runner import GuestRunner, RunRequest
    from app.worker.stats import StatsPage

    cache_dir = Path(args.cache_dir)
    stats = StatsPage(Path(args.stats), create=False)
    backend = _make_backend(args.backend, cache_dir, args.gpu_memory)
    memory = GuestMemory(args.pin_budget)  # one reused region instead of a fresh mapping per call
    if hasattr(backend, "attach_guest_memory"):
        backend.attach_guest_memory(memory)
    host = AbiHost(backend, args.max_buffers, args.max_modules, memory)
    host.usage_hook = lambda used: stats.set("gpu_bytes_in_use", used)
    runner = GuestRunner(make_engine(memory), ArtifactCache(cache_dir), host, args.tick_ms)
    runner.warm_up()
    memory.scrub()
    info = backend.info
    write_frame(
        proto_out,
        {
            "op": "ready",
            "pid": os.getpid(),
            "backend": info.backend,
            "device": {"name": info.name, "compute_capability": info.compute_capability, "total_memory_bytes": info.total_memory_bytes},
        },
    )
    invocations = 0
    while True:
        frame = read_frame(proto_in)
        if frame is None:
            return 0
        header, body = frame
        op = header.get("op")
        if op == "run":
            req = RunRequest(
                invocation_id=header["invocation_id"],
                function=header["function"],
                sha256=header["sha256"],
                env=header["env"],
                timeout_ms=header["timeout_ms"],
                wasm_memory_bytes=header["wasm_memory_bytes"],
                stdout_limit=header["stdout_limit"],
                stderr_limit=header["stderr_limit"],
                kernels=header.get("kernels"),
                traceparent=header.get("traceparent"),
            )
            res = runner.run(req, body)
            write_frame(
                proto_out,
                {
                    "op": "result",
                    "status": res.status,
                    "exit_code": res.exit_code,
                    "error": res.error,
                    "stdout_len": len(res.stdout),
                    "duration_ms": res.duration_ms,
                    "host": res.host,
                    **({"spans": res.spans} if res.spans else {}),
                },
                bytes(res.stdout) + res.stderr,
            )
            # after the reply, off the caller's path: scrub the guest's memory, publish counters
            memory.scrub()
            invocations += 1
            stats.set("invocations", invocations)
            stats.set("launches", host.launches_total)
        elif op == "bind":
            host.bind(int(header["gpu_memory_bytes"]))
            host.set_kernels(header.get("kernels") or {})
            stats.set("gpu_bytes_cap", int(header["gpu_memory_bytes"]))
            write_frame(proto_out, {"op": "ok"})
        elif op == "ping":
            write_frame(proto_out, {"op": "pong", "time": time.time()})
        elif op == "exit":
            return 0
        else:
            write_frame(proto_out, {"op": "error", "error": f"unknown op {op!r}"})


if __name__ == "__main__":
    sys.exit(main())
