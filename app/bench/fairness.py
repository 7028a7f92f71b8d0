"""`tensorwasm bench fairness`: a quiet tenant's latency while another tenant floods the node.

The flooding tenant keeps many long calls in flight (on the default quota: what any tenant may
do); the quiet tenant makes a short call every few hundred milliseconds, open loop. Run it with
`--server-root` pointing at another checkout to measure the code before a change the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import httpx

from app.bench.node import ADMIN, server, setup_tenant

NOOP_WAT = '(module (memory (export "memory") 1) (func (export "_start")))'


async def _latencies(client: httpx.AsyncClient, method: str, url: str, n: int, **kw: Any) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = await client.request(method, url, **kw)
        out.append(time.perf_counter() - t0)
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")
    return out


async def _quiesce(client: httpx.AsyncClient) -> None:
    """Wait until no worker is starting: a spawn costs seconds of CPU and would skew both sides."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        workers = (await client.get("/v1/admin/workers", headers=admin)).json()
        if not any(w["state"] == "starting" for w in workers):
            return
        await asyncio.sleep(0.2)


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def spin_wat(ms: int) -> str:
    """A guest that keeps its CPU busy for `ms` milliseconds (WASI monotonic clock)."""
    return f"""(module
  (import "wasi_snapshot_preview1" "clock_time_get" (func $clock (param i32 i64 i32) (result i32)))
  (memory (export "memory") 1)
  (func $now (result i64) (drop (call $clock (i32.const 1) (i64.const 1) (i32.const 0))) (i64.load (i32.const 0)))
  (func (export "_start") (local $end i64)
    (local.set $end (i64.add (call $now) (i64.const {ms * 1_000_000})))
    (loop $l (br_if $l (i64.lt_u (call $now) (local.get $end))))))"""


async def _fairness_bench(base: str, flood_calls: int, call_ms: int, seconds: float, gap_s: float) -> dict[str, Any]:
    import wasmtime

    setup = httpx.Client(base_url=base, timeout=60)
    # both tenants on the default quota: the flood is what any tenant may do
    flood = setup_tenant(setup, "flood", {"spin": bytes(wasmtime.wat2wasm(spin_wat(call_ms)))})
    quiet = setup_tenant(setup, "quiet", {"noop": bytes(wasmtime.wat2wasm(NOOP_WAT))})
    setup.close()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # no wait in the client
    flood_codes: dict[int, int] = {}
    quiet_codes: dict[int, int] = {}
    quiet_s: list[float] = []
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=120) as client:
        await _latencies(client, "POST", "/v1/functions/noop/invoke", 3, headers=quiet)  # bind, as a tenant seen before
        await _quiesce(client)
        stop = time.monotonic() + seconds

        async def flooder() -> None:  # keeps one call in flight, for as long as the flood lasts
            while time.monotonic() < stop:
                r = await client.post("/v1/functions/spin/invoke", headers=flood)
                flood_codes[r.status_code] = flood_codes.get(r.status_code, 0) + 1

        async def quiet_call() -> None:
            t0 = time.perf_counter()
            r = await client.post("/v1/functions/noop/invoke", headers=quiet)
            quiet_s.append(time.perf_counter() - t0)
            quiet_codes[r.status_code] = quiet_codes.get(r.status_code, 0) + 1

        async def quiet_caller() -> None:  # open loop: a call every gap_s, however long they take
            await asyncio.sleep(min(3.0, seconds / 4))  # the flood holds every worker it may by now
            calls = []
            while time.monotonic() < stop - call_ms / 1000:
                calls.append(asyncio.create_task(quiet_call()))
                await asyncio.sleep(gap_s)
            await asyncio.gather(*calls)

        await asyncio.gather(quiet_caller(), *(flooder() for _ in range(flood_calls)))
    return {
        "quiet_calls": len(quiet_s),
        "quiet_statuses": quiet_codes,
        "quiet_p50_ms": _pct(quiet_s, 0.5) * 1e3,
        "quiet_p99_ms": _pct(quiet_s, 0.99) * 1e3,
        "quiet_max_ms": max(quiet_s) * 1e3,
        "flood_statuses": flood_codes,
    }


def bench_fairness(args: argparse.Namespace) -> int:
    env = {"TENSORWASM_MAX_WORKERS": str(args.workers), "TENSORWASM_WARM_SPARES": "1"}
    with server(root=args.server_root, **env) as base:
        res = asyncio.run(_fairness_bench(base, args.flood, args.call_ms, args.seconds, args.gap_ms / 1000))
    print(json.dumps(res, indent=2))
    served = res["quiet_statuses"].get(200, 0)
    print(
        f"\nquiet tenant during a {args.flood}-call flood of {args.call_ms} ms calls on {args.workers} workers: "
        f"{served}/{res['quiet_calls']} served, p50 {res['quiet_p50_ms']:.1f} ms, p99 {res['quiet_p99_ms']:.1f} ms"
    )
    return 0
