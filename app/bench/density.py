"""`tensorwasm bench density`: how many tenants a node holds, and what switching between them costs.

Each phase drives a real node over HTTP with an echo guest, one tenant per API key:

- bound: `bound_tenants` tenants called once each, one after another, on a node with a worker for
  every one of them: the cold call (the bind of a worker to the tenant included). The calls start
  once the node's `bound_spares` spares are ready (exactly that many: the room's share is off);
  with neither `bound_spares` nor `spares` given the node keeps its default spares (its room's
  share, and those it keeps ahead of arriving tenants), and the calls start once it has started
  all it keeps while idle.
- burst: the same tenants' calls fired all at once, each to its bound worker.
- churn: more tenants than workers, `clients` callers picking a tenant at random per call: the
  goodput, and the tenant switch rate (binds per second, from the node's bind histogram) against
  the rate at which this host starts workers from the fork server, measured in the same run on an
  idle device and beside as many live workers as the churn node holds.
- ceiling: more tenants than TENSORWASM_MAX_CONTEXTS_PER_DEVICE (passed to the node; a node
  without that setting ignores it, and only its workers, at most the churn node's, hold the
  tenants back), all called at once: no call may wait longer than
  queue_wait + the tenant's timeout + 1 s; the share of 200/429/503 and Retry-After on each 503.
- memory: RSS and PSS of every worker (from /proc: the bench runs on the node's host), the host's
  memory, and the GPUs' memory where nvidia-smi is present; taken on each node before it stops.
- devices: workers and bound tenants per device (the `device` field of a worker; 0 when absent).
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import httpx

from app.bench.node import ADMIN, server, setup_tenant

BODY = b"hello"
FUNCTION = "echo"
MIB = 1024 * 1024


class Phase(StrEnum):
    BOUND = "bound"
    BURST = "burst"
    CHURN = "churn"
    CEILING = "ceiling"
    MEMORY = "memory"
    DEVICES = "devices"


@dataclass
class DensityConfig:
    backend: Literal["auto", "cpu", "cuda"] = "auto"
    bound_tenants: int = 64  # bound and burst: one worker each
    tenants: int = 96  # churn: more tenants than workers
    workers: int = 72
    clients: int = 16
    seconds: float = 30.0
    ceiling: int = 8  # TENSORWASM_MAX_CONTEXTS_PER_DEVICE of the ceiling node
    ceiling_tenants: int = 24
    ceiling_rounds: int = 3
    spares: int = 0  # TENSORWASM_WARM_SPARES of each node; 0: the node's default
    # spares of the bound node, all ready before its first call (0: `spares`): a node that keeps
    # as many spares as tenants arrive back to back binds each from a ready context
    bound_spares: int = 0
    queue_wait_ms: int = 1000
    timeout_ms: int = 5000  # every bench tenant's quota
    start_parallel: int = 0  # workers started at once for the start rate; 0: min(clients, workers)
    phases: frozenset[Phase] = frozenset(Phase)
    url: str | None = None  # a running node instead of one started here (its settings as they are)
    admin_token: str = ADMIN
    seed: int = 0


@dataclass
class Call:
    tenant: int
    status: int  # 0: no reply (connection error)
    seconds: float
    retry_after: bool


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


def _ms(calls: list[Call], ps: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, float]:
    xs = [c.seconds for c in calls]
    if not xs:
        return {}
    out = {f"p{round(p * 100)}": round(_pct(xs, p) * 1e3, 2) for p in ps}
    out["max"] = round(max(xs) * 1e3, 2)
    return out


def _statuses(calls: list[Call]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(Counter(c.status for c in calls).items())}


def _tenant_quota(cfg: DensityConfig) -> dict[str, Any]:
    # no rate or queue limit gets in the way; a small GPU cap so the device budget is not the limit
    return {"requests_per_second": 1_000_000, "max_concurrency": 4, "timeout_ms": cfg.timeout_ms, "gpu_memory_bytes": 64 * MIB}


def echo_wasm() -> bytes:
    import wasmtime

    from app.bench.invoke import ECHO_WAT

    return bytes(wasmtime.wat2wasm(ECHO_WAT))


def setup_tenants(base: str, label: str, n: int, cfg: DensityConfig) -> list[dict[str, str]]:
    """`n` tenants with the echo guest deployed (several at a time: each deploy is a compile)."""
    wasm, run = echo_wasm(), secrets.token_hex(3)  # a fresh name per run: a --url node has tenants already
    with httpx.Client(base_url=base, timeout=120) as client, ThreadPoolExecutor(8) as pool:
        return list(pool.map(
            lambda i: setup_tenant(client, f"density-{label}-{run}-{i}", {FUNCTION: wasm}, admin_token=cfg.admin_token, **_tenant_quota(cfg)), range(n)
        ))


def wait_spares(base: str, n: int, admin_token: str, timeout_s: float = 120) -> int:
    """Wait until the node has `n` spare workers and has started all it keeps while idle (no start
    under way in two looks, 0.2 s apart), or the timeout; returns how many spares it has."""
    deadline, have, settled = time.monotonic() + timeout_s, 0, 0
    with httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {admin_token}"}) as client:
        while time.monotonic() < deadline:
            states = [w["state"] for w in client.get("/v1/admin/workers").raise_for_status().json()]
            have = states.count("spare")
            settled = settled + 1 if "starting" not in states else 0
            if have >= n and settled >= 2:
                break
            time.sleep(0.2)
    return have


def _async_client(base: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # no wait in the client
    return httpx.AsyncClient(base_url=base, limits=limits, timeout=300)


async def _call(client: httpx.AsyncClient, headers: dict[str, str], tenant: int) -> Call:
    t0 = time.perf_counter()
    try:
        r = await client.post(f"/v1/functions/{FUNCTION}/invoke", content=BODY, headers=headers)
    except httpx.HTTPError:
        return Call(tenant, 0, time.perf_counter() - t0, False)
    return Call(tenant, r.status_code, time.perf_counter() - t0, "retry-after" in r.headers)


# -- phases -------------------------------------------------------------------------------------
async def bound_in_turn(base: str, keys: list[dict[str, str]]) -> dict[str, Any]:
    async with _async_client(base) as client:
        calls = [await _call(client, h, i) for i, h in enumerate(keys)]
    # each call's time in order too: which tenants found a spare ready and which waited for a start
    in_order = [round(c.seconds * 1000, 1) for c in calls]
    return {"tenants": len(keys), "statuses": _statuses(calls), "cold_ms": _ms(calls), "in_order_ms": in_order}


async def all_at_once(base: str, keys: list[dict[str, str]]) -> dict[str, Any]:
    async with _async_client(base) as client:
        t0 = time.perf_counter()
        calls = await asyncio.gather(*(_call(client, h, i) for i, h in enumerate(keys)))
        wall = time.perf_counter() - t0
    return {"calls": len(calls), "statuses": _statuses(list(calls)), "ms": _ms(list(calls), (0.5, 0.99)), "wall_s": round(wall, 3)}


def _metrics(client: httpx.Client, admin_token: str) -> dict[str, float] | None:
    """The node's Prometheus samples by name with labels; None where /metrics is closed to us."""
    r = client.get("/metrics")
    if r.status_code == 401:
        r = client.get("/metrics", headers={"Authorization": f"Bearer {admin_token}"})
    if r.status_code != 200:
        return None
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


BINDS = "tensorwasm_cold_start_seconds_count"
STARTS, START_SECONDS = "tensorwasm_worker_start_seconds_count", "tensorwasm_worker_start_seconds_sum"
EVICTED = 'tensorwasm_worker_restarts_total{reason="evicted"}'
START_FAILED = 'tensorwasm_worker_restarts_total{reason="start_failed"}'


async def churn(base: str, keys: list[dict[str, str]], clients: int, seconds: float, seed: int, admin_token: str) -> dict[str, Any]:
    rng = random.Random(seed)
    calls: list[Call] = []
    with httpx.Client(base_url=base, timeout=30) as sync:
        before = _metrics(sync, admin_token)
        async with _async_client(base) as client:
            stop = time.monotonic() + seconds

            async def caller() -> None:  # closed loop: the next call when the last one answered
                while time.monotonic() < stop:
                    i = rng.randrange(len(keys))
                    calls.append(await _call(client, keys[i], i))

            states: list[Counter[str]] = []

            async def watch() -> None:  # the node's workers by state: where does a switch wait?
                while time.monotonic() < stop:
                    r = await client.get("/v1/admin/workers", headers={"Authorization": f"Bearer {admin_token}"})
                    if r.status_code == 200:
                        states.append(Counter(w["state"] for w in r.json() if w["state"] != "dead"))
                    await asyncio.sleep(0.5)

            t0 = time.perf_counter()
            await asyncio.gather(watch(), *(caller() for _ in range(clients)))
            wall = time.perf_counter() - t0
        after = _metrics(sync, admin_token)
    ok = [c for c in calls if c.status == 200]
    res: dict[str, Any] = {
        "tenants": len(keys), "clients": clients, "wall_s": round(wall, 2), "calls": len(calls),
        "ok_per_s": round(len(ok) / wall, 1), "ms": _ms(ok, (0.5, 0.99)), "statuses": _statuses(calls),
        "max_wait_s": round(max((c.seconds for c in calls), default=0.0), 3),  # any status
        "503_with_retry_after": sum(1 for c in calls if c.status == 503 and c.retry_after),
        "binds": None, "switches_per_s": None, "evicted": None, "start_failed": None,
        "worker_states_mean": {k: round(sum(c[k] for c in states) / len(states), 1) for k in sorted(set().union(*states))} if states else {},
    }
    if before is not None and after is not None and BINDS in after:
        binds = after[BINDS] - before.get(BINDS, 0.0)
        res.update(
            binds=int(binds), switches_per_s=round(binds / wall, 2), evicted=int(after.get(EVICTED, 0.0) - before.get(EVICTED, 0.0)),
            start_failed=int(after.get(START_FAILED, 0.0) - before.get(START_FAILED, 0.0)),
        )
        starts = after.get(STARTS, 0.0) - before.get(STARTS, 0.0)
        if starts:  # how long the node's own starts took while it switched tenants
            res["node_starts"] = int(starts)
            res["node_start_ms_mean"] = round(1e3 * (after.get(START_SECONDS, 0.0) - before.get(START_SECONDS, 0.0)) / starts, 1)
    return res


async def past_ceiling(base: str, keys: list[dict[str, str]], rounds: int, bound_s: float, admin_token: str) -> dict[str, Any]:
    calls: list[Call] = []
    seen = 0
    done = asyncio.Event()
    async with _async_client(base) as client:

        async def watch() -> None:  # the most workers alive at once: did the ceiling hold them?
            nonlocal seen
            while True:  # once more after the last call: short calls may all fall between polls
                last = done.is_set()
                r = await client.get("/v1/admin/workers", headers={"Authorization": f"Bearer {admin_token}"})
                if r.status_code == 200:
                    seen = max(seen, sum(1 for w in r.json() if w["state"] != "dead"))
                if last:
                    return
                await asyncio.sleep(0.1)

        watcher = asyncio.create_task(watch())
        try:
            for _ in range(rounds):
                calls += await asyncio.gather(*(_call(client, h, i) for i, h in enumerate(keys)))
        finally:
            done.set()
            await watcher
    n = len(calls)
    by = Counter(c.status for c in calls)
    refused = [c for c in calls if c.status == 503]
    longest = max(c.seconds for c in calls)
    return {
        "tenants": len(keys), "calls": n, "statuses": _statuses(calls),
        "share": {s: round(by.get(int(s), 0) / n, 3) for s in ("200", "429", "503")}
        | {"other": round(sum(v for k, v in by.items() if k not in (200, 429, 503)) / n, 3)},
        "503_with_retry_after": sum(1 for c in refused if c.retry_after), "503": len(refused),
        "max_wait_s": round(longest, 3), "bound_s": bound_s, "bound_held": longest <= bound_s,
        "workers_seen_max": seen,
    }


# -- snapshots of a node --------------------------------------------------------------------------
def _smaps(pid: int) -> tuple[float, float] | None:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:  # gone, or not on this host
        return None
    kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in text.splitlines()[1:] if ":" in line)}
    return kb.get("Rss", 0) / 1024, kb.get("Pss", 0) / 1024


def _host_mib() -> dict[str, float]:
    kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())}
    return {"host_used_mib": round((kb["MemTotal"] - kb["MemAvailable"]) / 1024, 1), "host_total_mib": round(kb["MemTotal"] / 1024, 1)}


def gpu_memory() -> list[dict[str, int]] | None:
    """Memory used/total (MiB) per GPU from nvidia-smi; None where it is absent or fails."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[int(x) for x in line.split(",")] for line in out.splitlines() if line.strip()]
    return [{"index": i, "used_mib": used, "total_mib": total} for i, used, total in rows]


def memory(workers: list[dict[str, Any]]) -> dict[str, Any]:
    per = [m for m in (_smaps(int(w["pid"])) for w in workers if w.get("pid")) if m is not None]
    rss, pss = [m[0] for m in per], [m[1] for m in per]
    res: dict[str, Any] = {"workers": len(per)}
    if per:
        res |= {
            "rss_mib_mean": round(statistics.fmean(rss), 1), "rss_mib_max": round(max(rss), 1),
            "pss_mib_mean": round(statistics.fmean(pss), 1), "pss_mib_max": round(max(pss), 1),
            "pss_mib_total": round(sum(pss), 1),
        }
    return res | _host_mib() | {"gpus": gpu_memory()}


def devices(workers: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, Any]] = {}
    for w in workers:
        if w["state"] == "dead":
            continue
        d = out.setdefault(str(w.get("device") or 0), {"workers": 0, "tenants": set()})
        d["workers"] += 1
        if w.get("tenant_id"):
            d["tenants"].add(w["tenant_id"])
    return {k: {"workers": v["workers"], "bound_tenants": len(v["tenants"])} for k, v in sorted(out.items())}


def snapshot(base: str, cfg: DensityConfig, res: dict[str, Any], label: str) -> None:
    if not cfg.phases & {Phase.MEMORY, Phase.DEVICES}:
        return
    r = httpx.get(f"{base}/v1/admin/workers", headers={"Authorization": f"Bearer {cfg.admin_token}"}, timeout=30)
    r.raise_for_status()
    workers = r.json()
    if Phase.MEMORY in cfg.phases:
        res.setdefault("memory", {})[label] = memory(workers)
    if Phase.DEVICES in cfg.phases:
        res.setdefault("devices", {})[label] = devices(workers)


# -- the run --------------------------------------------------------------------------------------
@contextmanager
def _node(cfg: DensityConfig, max_workers: int, spares: int | None = None, **env: str) -> Iterator[str]:
    if cfg.url:
        yield cfg.url
        return
    warm = cfg.spares if spares is None else spares
    if warm:  # else the node's default (its room's share among them)
        env["TENSORWASM_WARM_SPARES"] = str(warm)
        env["TENSORWASM_SPARE_ROOM_SHARE"] = "0"  # as many as asked for, not the room's share
    with server(
        TENSORWASM_BACKEND=cfg.backend, TENSORWASM_MAX_WORKERS=str(max_workers), TENSORWASM_QUEUE_WAIT_MS=str(cfg.queue_wait_ms), **env,
    ) as base:
        yield base


def run_density(cfg: DensityConfig) -> dict[str, Any]:
    res: dict[str, Any] = {"config": {k: sorted(v) if isinstance(v, frozenset) else v for k, v in asdict(cfg).items() if k != "admin_token"}}
    if Phase.CHURN in cfg.phases:
        from app.bench.workers import fork_starts_per_s

        # first, on an idle host: a node's workers (or those of a node just stopped, still
        # exiting) would compete for the same cores and GPU
        n = cfg.start_parallel or min(cfg.clients, cfg.workers)
        starts = round(asyncio.run(fork_starts_per_s(cfg.backend, n, batches=5)), 2)
        # and beside as many live workers as the churn node holds while it starts those: the
        # driver creates a context more slowly on a device that holds many
        held = max(0, cfg.workers - n)
        starts_full = round(asyncio.run(fork_starts_per_s(cfg.backend, n, batches=3, held=held)), 2)
    if cfg.phases & {Phase.BOUND, Phase.BURST}:
        # a worker for every tenant, and the spares beside them
        spares = cfg.bound_spares or cfg.spares  # 0: the node's default
        with _node(cfg, cfg.bound_tenants + max(1, cfg.spares), spares) as base:
            keys = setup_tenants(base, "bound", cfg.bound_tenants, cfg)
            if Phase.BOUND in cfg.phases:
                ready = wait_spares(base, max(1, spares), cfg.admin_token)
                res["bound"] = asyncio.run(bound_in_turn(base, keys)) | {"spares": spares or "default", "spares_ready": ready}
            if Phase.BURST in cfg.phases:
                res["burst"] = asyncio.run(all_at_once(base, keys))
            snapshot(base, cfg, res, "bound")
    if Phase.CHURN in cfg.phases:
        with _node(cfg, cfg.workers) as base:
            keys = setup_tenants(base, "churn", cfg.tenants, cfg)
            c = res["churn"] = asyncio.run(churn(base, keys, cfg.clients, cfg.seconds, cfg.seed, cfg.admin_token))
            snapshot(base, cfg, res, "churn")
        c["start_parallel"], c["starts_per_s"] = n, starts
        c["switch_to_start_ratio"] = round(c["switches_per_s"] / starts, 3) if c["switches_per_s"] is not None else None
        c["starts_held"], c["starts_per_s_held"] = held, starts_full
        c["switch_to_held_start_ratio"] = round(c["switches_per_s"] / starts_full, 3) if c["switches_per_s"] is not None else None
    if Phase.CEILING in cfg.phases:
        # the churn node's workers at most: on a node without the ceiling setting they are the limit
        max_workers = min(cfg.ceiling_tenants + max(1, cfg.spares), cfg.workers)
        with _node(cfg, max_workers, TENSORWASM_MAX_CONTEXTS_PER_DEVICE=str(cfg.ceiling)) as base:
            keys = setup_tenants(base, "ceiling", cfg.ceiling_tenants, cfg)
            bound_s = (cfg.queue_wait_ms + cfg.timeout_ms) / 1000 + 1.0
            ceiling = asyncio.run(past_ceiling(base, keys, cfg.ceiling_rounds, bound_s, cfg.admin_token))
            res["ceiling"] = ceiling | {"ceiling": cfg.ceiling, "max_workers": max_workers}
            snapshot(base, cfg, res, "ceiling")
    return res


def _row(name: str, value: object) -> str:
    return f"  {name:34} {value}"


def _lat(d: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.1f}" for k, v in d.items()) + " ms" if d else "-"


def report(res: dict[str, Any]) -> str:
    lines = []
    if "bound" in res:
        b = res["bound"]
        ready = f"{b['spares_ready']} of {b['spares']}" if b["spares"] != "default" else f"the node's default, {b['spares_ready']}"
        lines += [
            f"bound in turn ({b['tenants']} tenants, one call each, {ready} spares ready at the first)",
            _row("cold call", _lat(b["cold_ms"])), _row("statuses", b["statuses"]),
        ]
    if "burst" in res:
        b = res["burst"]
        lines += [f"all at once ({b['calls']} calls)", _row("latency", _lat(b["ms"])), _row("statuses", b["statuses"]), _row("wall", f"{b['wall_s']} s")]
    if "churn" in res:
        c = res["churn"]
        cfg = res["config"]
        lines += [
            f"churn ({c['tenants']} tenants over {cfg['workers']} workers, {c['clients']} clients, {c['wall_s']} s)",
            _row("calls/s (200)", c["ok_per_s"]), _row("latency (200)", _lat(c["ms"])), _row("statuses", c["statuses"]),
            _row("longest wait (any status)", f"{c['max_wait_s']} s"),
            _row("503 with Retry-After", f"{c['503_with_retry_after']}/{c['statuses'].get('503', 0)}"),
            _row("workers by state (mean)", c["worker_states_mean"]),
            _row("the node's worker starts, mean", f"{c.get('node_starts', 0)} in {c.get('node_start_ms_mean', '-')} ms"),
            _row("tenant switches (binds)", f"{c['binds']} ({c['switches_per_s']}/s), {c['evicted']} evicted, {c['start_failed']} starts failed"),
            _row(f"worker starts, {c['start_parallel']} at once", f"{c['starts_per_s']}/s"),
            _row("switch rate / start rate", c["switch_to_start_ratio"]),
            _row(f"worker starts, {c['start_parallel']} at once beside {c['starts_held']} live", f"{c['starts_per_s_held']}/s"),
            _row("switch rate / that start rate", c["switch_to_held_start_ratio"]),
        ]
    if "ceiling" in res:
        c = res["ceiling"]
        held = "held" if c["bound_held"] else "EXCEEDED"
        lines += [
            f"past the ceiling ({c['tenants']} tenants, {c['ceiling']} contexts per device, {c['max_workers']} workers, {c['calls']} calls)",
            _row("share 200/429/503/other", "/".join(str(c["share"][k]) for k in ("200", "429", "503", "other"))),
            _row("503 with Retry-After", f"{c['503_with_retry_after']}/{c['503']}"),
            _row("longest wait", f"{c['max_wait_s']} s (bound {c['bound_s']} s: {held})"),
            _row("most workers alive at once", c["workers_seen_max"]),
        ]
    for label, m in res.get("memory", {}).items():
        lines.append(f"memory after {label} ({m['workers']} workers)")
        if m["workers"]:
            lines += [
                _row("RSS per worker mean/max", f"{m['rss_mib_mean']}/{m['rss_mib_max']} MiB"),
                _row("PSS per worker mean/max, total", f"{m['pss_mib_mean']}/{m['pss_mib_max']} MiB, {m['pss_mib_total']} MiB"),
            ]
        lines.append(_row("host used/total", f"{m['host_used_mib']}/{m['host_total_mib']} MiB"))
        for g in m["gpus"] or []:
            lines.append(_row(f"GPU {g['index']} used/total", f"{g['used_mib']}/{g['total_mib']} MiB"))
    for label, ds in res.get("devices", {}).items():
        lines.append(f"devices after {label}")
        lines += [_row(f"device {d}", f"{v['workers']} workers, {v['bound_tenants']} tenants bound") for d, v in ds.items()]
    return "\n".join(lines)


def bench_density(cfg: DensityConfig, json_path: Path | None = None) -> int:
    res = run_density(cfg)
    print(report(res))
    if json_path is not None:
        json_path.write_text(json.dumps(res, indent=2) + "\n")
    # the one promise this bench checks: no call waits past its queue wait and its timeout
    return 0 if res.get("ceiling", {}).get("bound_held", True) else 1


__all__ = ["Call", "DensityConfig", "Phase", "bench_density", "report", "run_density"]

