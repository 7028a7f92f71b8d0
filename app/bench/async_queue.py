"""`tensorwasm bench async`: the async queue and streaming, on a real node.

Prints: submit-to-start latency of an async invocation at an idle node (p50/p99, from the
server's own `created_at`/`started_at`), queue throughput (no-op async invocations drained per
second, from the records' first start to last end), and the delay from a guest's stdout write to
the client over SSE (p50/p99; the guest stamps each write with the WASI realtime clock, the
client compares with its own clock on arrival: same host, same clock).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime
from typing import Any

import httpx
import wasmtime

from app.bench.node import ADMIN, server, setup_tenant

NOOP_WAT = '(module (memory (export "memory") 1) (func (export "_start")))'
SPIN_WAT = '(module (memory (export "memory") 1) (func (export "_start") (loop $l (br $l))))'

# Writes its WASI realtime clock (ns, decimal, one line) 25 times, 20 ms apart.
STAMP_WAT = r"""
(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "clock_time_get" (func $clock (param i32 i64 i32) (result i32)))
  (memory (export "memory") 1)
  (func $now (result i64)
    (drop (call $clock (i32.const 0) (i64.const 1) (i32.const 16)))
    (i64.load (i32.const 16)))
  (func $emit (param $t i64) (local $p i32)
    (local.set $p (i32.const 95))
    (i32.store8 (local.get $p) (i32.const 10))
    (loop $d
      (local.set $p (i32.sub (local.get $p) (i32.const 1)))
      (i32.store8 (local.get $p) (i32.add (i32.const 48) (i32.wrap_i64 (i64.rem_u (local.get $t) (i64.const 10)))))
      (local.set $t (i64.div_u (local.get $t) (i64.const 10)))
      (br_if $d (i64.ne (local.get $t) (i64.const 0))))
    (i32.store (i32.const 0) (local.get $p))
    (i32.store (i32.const 4) (i32.sub (i32.const 96) (local.get $p)))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8))))
  (func (export "_start") (local $i i32) (local $until i64)
    (loop $l
      (call $emit (call $now))
      (local.set $until (i64.add (call $now) (i64.const 20000000)))
      (loop $w (br_if $w (i64.lt_u (call $now) (local.get $until))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const 25))))))
"""


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def _ts(s: str) -> float:
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def _wait_all(client: httpx.Client, key: dict[str, str], ids: list[str], timeout_s: float = 600) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    done: dict[str, dict[str, Any]] = {}
    while len(done) < len(ids):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(ids) - len(done)} async invocations did not end in time")
        for i in ids:
            if i not in done:
                rec = client.get(f"/v1/invocations/{i}", headers=key).json()
                if rec["status"] not in ("queued", "running"):
                    if rec["status"] != "succeeded":
                        raise RuntimeError(f"invocation {i} ended {rec['status']}: {rec['error']}")
                    done[i] = rec
                else:
                    break  # FIFO: later ones are not done either
        time.sleep(0.02)
    return [done[i] for i in ids]


def start_latency(client: httpx.Client, key: dict[str, str], n: int) -> list[float]:
    """One at a time at an idle node: seconds from the 202's record to the claim that started it."""
    out = []
    for _ in range(n):
        r = client.post("/v1/functions/noop/invocations", headers=key)
        r.raise_for_status()
        rec = _wait_all(client, key, [r.json()["id"]])[0]
        out.append(_ts(rec["started_at"]) - _ts(rec["created_at"]))
    return out


def throughput(client: httpx.Client, key: dict[str, str], tenant_id: str, quota: dict[str, Any], n: int) -> float:
    """Drain rate of a full queue: with the tenant's one slot held by a spinning invocation, `n`
    no-ops are queued; then its concurrency is raised, and the rate is `n` over the time from
    the first no-op's start to the last one's end (server timestamps)."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    client.put(f"/v1/admin/tenants/{tenant_id}/quota", json={**quota, "max_concurrency": 1}, headers=admin).raise_for_status()
    blocker = client.post("/v1/functions/spin/invocations", headers=key).json()["id"]
    while client.get(f"/v1/invocations/{blocker}", headers=key).json()["status"] != "running":
        time.sleep(0.02)
    ids = []
    for _ in range(n):
        r = client.post("/v1/functions/noop/invocations", headers=key)
        r.raise_for_status()
        ids.append(r.json()["id"])
    client.put(f"/v1/admin/tenants/{tenant_id}/quota", json=quota, headers=admin).raise_for_status()
    recs = _wait_all(client, key, ids)
    client.post(f"/v1/invocations/{blocker}/cancel", headers=key)
    first = min(_ts(r["started_at"]) for r in recs)
    last = max(_ts(r["ended_at"]) for r in recs)
    return n / (last - first)


def stream_delays(client: httpx.Client, key: dict[str, str], calls: int) -> list[float]:
    delays = []
    for _ in range(calls):
        with client.stream("POST", "/v1/functions/stamp/invoke", headers={**key, "Accept": "text/event-stream"}) as r:
            r.raise_for_status()
            event = None
            for line in r.iter_lines():
                now = time.time_ns()
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "output" and line[6:].isdigit():
                    delays.append((now - int(line[6:])) / 1e9)
    return delays


def run(args: argparse.Namespace) -> dict[str, Any]:
    wasm = {name: bytes(wasmtime.wat2wasm(w)) for name, w in (("noop", NOOP_WAT), ("stamp", STAMP_WAT), ("spin", SPIN_WAT))}
    env = {"TENSORWASM_BACKEND": args.backend}
    quota = {"requests_per_second": 1_000_000, "max_queued": 1_000_000, "max_concurrency": args.concurrency, "timeout_ms": 120_000}
    with server(**env) as base, httpx.Client(base_url=base, timeout=120) as client:
        key = setup_tenant(client, "bench-async", wasm, **quota)
        tenant_id = next(
            t["id"] for t in client.get("/v1/admin/tenants", headers={"Authorization": f"Bearer {ADMIN}"}).json()
            if t["name"] == "bench-async"
        )
        start_latency(client, key, 5)  # warm: the tenant's worker bound, the caches filled
        lat = start_latency(client, key, args.n)
        tput = throughput(client, key, tenant_id, quota, args.drain)
        delays = stream_delays(client, key, args.stream_calls)
    result = {
        "async_submit_to_start_ms": {"p50": _pct(lat, 0.5) * 1000, "p99": _pct(lat, 0.99) * 1000, "n": len(lat)},
        "queue_throughput_per_s": tput,
        "queue_drained": args.drain,
        "queue_concurrency": args.concurrency,
        "stream_write_to_client_ms": {"p50": _pct(delays, 0.5) * 1000, "p99": _pct(delays, 0.99) * 1000, "n": len(delays)},
    }
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=100, help="async invocations for the start latency (one at a time)")
    p.add_argument("--drain", type=int, default=1000, help="no-op async invocations queued for the throughput")
    p.add_argument("--stream-calls", type=int, default=8, help="streamed calls of 25 stamped writes each")
    p.add_argument("--concurrency", type=int, default=4, help="the tenant's max_concurrency while the queue drains")
    p.add_argument("--backend", default="cpu", choices=("cpu", "cuda", "auto"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tensorwasm bench async", description=__doc__)
    add_arguments(p)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        s, t, d = res["async_submit_to_start_ms"], res["queue_throughput_per_s"], res["stream_write_to_client_ms"]
        print(f"async submit-to-start (idle node): p50 {s['p50']:.2f} ms  p99 {s['p99']:.2f} ms  (n={s['n']})")
        print(f"queue throughput: {t:.0f} no-op invocations/s drained ({res['queue_drained']} queued, tenant concurrency {res['queue_concurrency']})")
        print(f"stream delay, guest write -> client (SSE): p50 {d['p50']:.2f} ms  p99 {d['p99']:.2f} ms  (n={d['n']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
