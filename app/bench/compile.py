"""`tensorwasm bench compile`: a compile bomb against a real server with the default limits.

The bomb is a valid WASI command whose one function has many i64 locals and many small `if`
blocks that each add two locals: cranelift's memory grows with locals x blocks (5,000 x 50,000,
896 KB: compiled without a limit it asked for 26 GB). The bench reports how the node refuses it
(status, code, message, seconds), the compile process's peak memory (VmHWM sampled from /proc),
the api process's RSS before and after, and another tenant's small deploys (and a call) before
and while it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from app.bench.cpu import children


def compile_bomb_wat(n_locals: int, n_blocks: int) -> str:
    """WAT of a module that is cheap to send and expensive to compile (see the module doc)."""
    body = []
    for i in range(n_blocks):
        a, b, c = (1 + (i * k + j) % n_locals for k, j in ((7, 0), (13, 1), (31, 2)))
        body.append(f"(if (i32.and (local.get 0) (i32.const {1 + i % 63})) (then (local.set {a} (i64.add (local.get {b}) (local.get {c})))))")
    return "\n".join(
        [
            '(module (memory (export "memory") 1)',
            "(func $f (param i32) (result i64)",
            "(local " + " ".join(["i64"] * n_locals) + ")",
            *body,
            "(local.get 1))",
            '(func (export "_start") (drop (call $f (i32.const 7)))))',
        ]
    )


def small_module_wat(tag: str) -> str:
    """A tiny valid command; `tag` makes its bytes (so its sha256 and its compile) unique."""
    return f'(module (memory (export "memory") 1) (data (i32.const 0) "{tag}") (func (export "_start")))'


def _status(pid: int, field: str) -> int:
    """A `Vm*` field of /proc/PID/status in bytes (0 once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _children(pid: int) -> list[int]:
    return children().get(pid, [])


def _server_pid() -> int:
    for pid in _children(os.getpid()):
        if b"app.cli" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise RuntimeError("the server process was not found")


class PeakSampler(threading.Thread):
    """Samples VmHWM of the server's compile processes every 20 ms; keeps the largest."""

    def __init__(self, server: int) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for pid in _children(self.server):
                try:
                    if b"app.sandbox.child" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        self.peak = max(self.peak, _status(pid, "VmHWM"))
                except OSError:
                    pass
            time.sleep(0.02)


def _deploy(client: httpx.Client, headers: dict[str, str], name: str, wasm: bytes) -> tuple[float, httpx.Response]:
    t0 = time.perf_counter()
    r = client.put(f"/v1/functions/{name}", content=wasm, headers={**headers, "Content-Type": "application/wasm"})
    return time.perf_counter() - t0, r


def bench_compile(args: argparse.Namespace) -> int:
    import wasmtime

    from app.bench.node import server, setup_tenant

    bomb = bytes(wasmtime.wat2wasm(compile_bomb_wat(args.locals, args.blocks)))
    res: dict[str, Any] = {"bomb_bytes": len(bomb), "bomb_locals": args.locals, "bomb_blocks": args.blocks}
    with server() as base, httpx.Client(base_url=base, timeout=600) as client:
        api = _server_pid()
        quiet = setup_tenant(client, "quiet", {})
        noisy = setup_tenant(client, "noisy", {})
        small = [bytes(wasmtime.wat2wasm(small_module_wat(f"s{i}"))) for i in range(args.small)]
        res["small_module_bytes"] = len(small[0])
        idle = []
        for i, wasm in enumerate(small):
            time.sleep(0.5)  # deploys arrive apart, as they do: the pool refills between them
            dt, r = _deploy(client, quiet, f"idle{i}", wasm)
            r.raise_for_status()
            idle.append(dt)
        res["small_deploy_s_median"] = statistics.median(idle)
        res["small_deploy_s_max"] = max(idle)
        time.sleep(1)
        res["api_rss_before"] = _status(api, "VmRSS")
        sampler = PeakSampler(api)
        sampler.start()
        outcome: dict[str, Any] = {}

        def send_bomb() -> None:
            with httpx.Client(base_url=base, timeout=600) as c:
                dt, r = _deploy(c, noisy, "bomb", bomb)
                outcome.update(seconds=dt, status=r.status_code, error=r.json().get("error"))

        t = threading.Thread(target=send_bomb)
        t.start()
        time.sleep(1)
        during: list[float] = []
        while t.is_alive() and len(during) < args.small:
            dt, r = _deploy(client, quiet, f"during{len(during)}", bytes(wasmtime.wat2wasm(small_module_wat(f"d{len(during)}"))))
            r.raise_for_status()
            during.append(dt)
            time.sleep(0.5)
        t.join()
        sampler.stop.set()
        sampler.join()
        call = client.post("/v1/functions/idle0/invoke", headers=quiet)
        res.update(
            bomb_refused_after_s=outcome["seconds"],
            bomb_status=outcome["status"],
            bomb_error=outcome["error"],
            compile_process_peak_rss=sampler.peak,
            api_rss_after=_status(api, "VmRSS"),
            small_deploys_during_bomb=len(during),
            small_deploy_during_s_max=max(during) if during else None,
            quiet_invoke_after_status=call.status_code,
        )
    print(json.dumps(res, indent=2))
    return 0
