"""Benchmarks (`tensorwasm bench invoke|gpu|compile`). Every figure is printed next to a baseline
measured in the same run, as a ratio, so results compare across machines."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Iterator

import httpx

from app.settings import REPO_ROOT

ADMIN = "bench-admin-token"
NOOP_WAT = '(module (memory (export "memory") 1) (func (export "_start")))'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server(**env: str) -> Iterator[str]:
    """A real `tensorwasm serve` on a free port with a fresh SQLite data dir."""
    with tempfile.TemporaryDirectory(prefix="tw-bench-") as data:
        port = _free_port()
        full = {
            **os.environ,
            "TENSORWASM_DATA_DIR": data,
            "TENSORWASM_ADMIN_TOKEN": ADMIN,
            "TENSORWASM_PORT": str(port),
            "TENSORWASM_LOG_LEVEL": "warning",
            **env,
        }
        full.pop("TENSORWASM_DATABASE_URL", None)
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve"], env=full, cwd=REPO_ROOT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server did not start")
                time.sleep(0.1)
            yield base
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def setup_tenant(client: httpx.Client, name: str, functions: dict[str, bytes], **quota: Any) -> dict[str, str]:
    """Create a tenant and a key, deploy `functions` (name -> module); returns its auth header."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = client.post("/v1/admin/tenants", json={"name": name, "quota": quota}, headers=admin)
    r.raise_for_status()
    key = client.post(f"/v1/admin/tenants/{r.json()['id']}/api-keys", headers=admin).json()["key"]
    headers = {"Authorization": f"Bearer {key}"}
    for fn, wasm in functions.items():
        client.put(f"/v1/functions/{fn}", content=wasm, headers={**headers, "Content-Type": "application/wasm"}).raise_for_status()
    return headers


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


async def _throughput(client: httpx.AsyncClient, method: str, url: str, n: int, conc: int, **kw: Any) -> float:
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            r = await client.request(method, url, **kw)
            if r.status_code != 200:
                raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return n / (time.perf_counter() - t0)


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


async def _invoke_bench(base: str, requests: int, conc: int) -> dict[str, float]:
    import wasmtime

    wasm = bytes(wasmtime.wat2wasm(NOOP_WAT))
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    setup = httpx.Client(base_url=base, timeout=60)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as client:
        # cold start: the first call of a newly deployed tenant (binds a warm spare)
        cold = []
        for i in range(5):
            headers = setup_tenant(setup, f"cold{i}", {"f": wasm}, requests_per_second=1e6, max_concurrency=conc)
            # longer than the cache TTL, as between real arrivals: the spare pool refills and the
            # call finds the tenant's cache entries only as kept fresh in the background
            await asyncio.sleep(2.5)
            t0 = time.perf_counter()
            r = await client.post("/v1/functions/f/invoke", headers=headers)
            cold.append(time.perf_counter() - t0)
            r.raise_for_status()
        headers = setup_tenant(setup, "hot", {"f": wasm}, requests_per_second=1e6, max_concurrency=conc)
        inv = {"headers": headers}
        await _latencies(client, "POST", "/v1/functions/f/invoke", 50, **inv)  # bind the hot tenant
        await _quiesce(client)
        await _latencies(client, "POST", "/v1/functions/f/invoke", 200, **inv)  # warm up
        await _latencies(client, "GET", "/healthz", 200)
        # alternate the two, so machine drift during the run lands on both sides equally
        bare, warm = [], []
        for _ in range(requests):
            bare += await _latencies(client, "GET", "/healthz", 1)
            warm += await _latencies(client, "POST", "/v1/functions/f/invoke", 1, **inv)
        await _throughput(client, "POST", "/v1/functions/f/invoke", conc * 10, conc, **inv)
        bare_tp = await _throughput(client, "GET", "/healthz", requests * 2, conc)
        inv_tp = await _throughput(client, "POST", "/v1/functions/f/invoke", requests * 2, conc, **inv)
    setup.close()
    return {
        "bare_p50_ms": _pct(bare, 0.5) * 1e3,
        "bare_p99_ms": _pct(bare, 0.99) * 1e3,
        "invoke_p50_ms": _pct(warm, 0.5) * 1e3,
        "invoke_p99_ms": _pct(warm, 0.99) * 1e3,
        "bare_rps_c32": bare_tp,
        "invoke_rps_c32": inv_tp,
        "cold_start_ms_median": statistics.median(cold) * 1e3,
        "cold_start_ms_max": max(cold) * 1e3,
    }


def bench_invoke(args: argparse.Namespace) -> int:
    with server(TENSORWASM_MAX_WORKERS=str(os.environ.get("TENSORWASM_MAX_WORKERS", "8")), TENSORWASM_WARM_SPARES="2") as base:
        res = asyncio.run(_invoke_bench(base, args.requests, args.concurrency))
    print(json.dumps(res, indent=2))
    p50_ratio = res["invoke_p50_ms"] / res["bare_p50_ms"]
    tp_ratio = res["invoke_rps_c32"] / res["bare_rps_c32"]
    rows = [
        ("invoke p50 / bare p50 (c=1)", f"{p50_ratio:.2f}x", "<= 2x", p50_ratio <= 2),
        ("invoke p99 / bare p99 (c=1)", f"{res['invoke_p99_ms'] / res['bare_p99_ms']:.2f}x", "", True),
        (f"invoke rps / bare rps (c={args.concurrency})", f"{tp_ratio:.2f}x", ">= 0.35x", tp_ratio >= 0.35),
        ("cold start (median of 5)", f"{res['cold_start_ms_median']:.1f} ms", "<= 10 ms", res["cold_start_ms_median"] <= 10),
        ("warm invoke p50", f"{res['invoke_p50_ms']:.2f} ms", "", True),
    ]
    print(f"\n{'metric':44} {'value':>10}  {'target':10} ok")
    for name, value, target, ok in rows:
        print(f"{name:44} {value:>10}  {target:10} {'yes' if ok else 'NO'}")
    return 0


def main(args: argparse.Namespace) -> int:
    if args.bench_cmd == "invoke":
        return bench_invoke(args)
    if args.bench_cmd == "compile":
        from app.sandbox.bench import bench_compile

        return bench_compile(args)
    from app.gpu.bench import bench_gpu

    return bench_gpu(args)
