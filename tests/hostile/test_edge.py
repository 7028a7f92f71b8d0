"""The edge under attack, on a real node of two fronts (docs/operations.md, "Edge limits"):
20,000 connections that never finish their head, endless headers, 1,000 unauthenticated bodies
held open, and a flood of keys that do not exist. Each attacker runs as its own process
(tests/hostile/attack.py) from its own loopback address, while this test calls the node as a
tenant would."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.settings import Settings
from tests.helpers import ADMIN_TOKEN, checkout_pythonpath, deploy, new_tenant, server_process, wat
from tests.node.helpers import NO_KEEPALIVE, fronts

pytestmark = pytest.mark.slow

HEAD_TIMEOUT_S = 3.0
FRONTS = 2
# attackers with cores of their own; with fewer they share the node's, and the bounds below widen
MANY_CORES = (os.cpu_count() or 1) >= 4
# how long a probe may take to be answered at all. On 2 cores shared with the attackers, CI once
# saw one probe of six take past 5 s (the others 0.25-1.5 s). Where timed (the dev VM), the wait
# comes after the TCP connect (connects within 13 ms, probes 0.2-0.35 s): the connection behind
# thousands of the attackers' to be accepted and read, on cores the attackers also take
PROBE_TIMEOUT_S = 5.0 if MANY_CORES else 10.0


@pytest.fixture(scope="module")
def node(server_database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    env = {
        "TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN,
        "TENSORWASM_PROCESSES": str(FRONTS),
        "TENSORWASM_HEAD_TIMEOUT_S": str(HEAD_TIMEOUT_S),
        "TENSORWASM_LOG_LEVEL": "warning",
    }
    with server_process(tmp_path_factory.mktemp("edge"), server_database_url, env=env) as server:
        yield server.proc, server.url


def _attack(kind: str, port: int, source: str, count: int, seconds: float, *more: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.hostile.attack", kind,
         "--port", str(port), "--source", source, "--count", str(count), "--seconds", str(seconds), *more],
        stdout=subprocess.PIPE, text=True, env={"PYTHONPATH": checkout_pythonpath(), "PATH": "/usr/bin:/bin"},
    )


def _report(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return dict(json.loads(out.strip().splitlines()[-1]))


async def _tenant(base: str) -> dict[str, str]:
    async with httpx.AsyncClient(base_url=base, timeout=30, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as admin:
        _, key = await new_tenant(admin, requests_per_second=10_000)
        assert (await deploy(admin, key, "echo", wat("echo"))).status_code == 201
    return key


@dataclass
class Probes:
    took: list[float] = field(default_factory=list)  # each probe's latency; a failure counts as PROBE_TIMEOUT_S
    failures: list[str] = field(default_factory=list)  # what each failed probe saw
    connects: list[float] = field(default_factory=list)  # each TCP connect: the kernel's part, SYN retransmits included


async def _probe(base: str, key: dict[str, str], seconds: float) -> Probes:
    """A tenant's invoke and /healthz, each on a new connection, one after the other for
    `seconds`."""
    probes = Probes()
    end = time.monotonic() + seconds
    marks: dict[str, float] = {}

    async def trace(event: str, _: object) -> None:
        marks[event] = time.monotonic()

    ext = {"trace": trace}
    async with httpx.AsyncClient(base_url=base, timeout=PROBE_TIMEOUT_S, limits=NO_KEEPALIVE) as client:
        while time.monotonic() < end:
            for send in (
                lambda: client.get("/healthz", extensions=ext),
                lambda: client.post("/v1/functions/echo/invoke", content=b"hi", headers=key, extensions=ext),
            ):
                marks.clear()
                t0 = time.monotonic()
                try:
                    r = await send()
                    ok = r.status_code == 200
                    if not ok:
                        probes.failures.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as e:
                    ok = False
                    probes.failures.append(f"{type(e).__name__} after {time.monotonic() - t0:.2f} s: {e}")
                if "connection.connect_tcp.complete" in marks:
                    probes.connects.append(marks["connection.connect_tcp.complete"] - marks["connection.connect_tcp.started"])
                probes.took.append(time.monotonic() - t0 if ok else PROBE_TIMEOUT_S)
            await asyncio.sleep(0.02)
    return probes


async def _slow_heads(port: int, count: int, within: float) -> list[float]:
    """`count` slow heads of our own, opened over `within` seconds among the attackers': how long
    each lived until the node closed it."""

    async def one(delay: float) -> float:
        await asyncio.sleep(delay)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S * 4):  # past any bound below: a head never closed fails there
                while await reader.read(4096):
                    pass
        finally:
            writer.close()
        return time.monotonic() - t0

    return list(await asyncio.gather(*(one(within * i / count) for i in range(count))))


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


def _p99(values: list[float]) -> float:
    return _pct(values, 0.99)


def _p90(values: list[float]) -> float:
    return _pct(values, 0.90)


def _rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


async def test_twenty_thousand_slow_heads_leave_the_node_answering(node: tuple[Any, str]) -> None:
    _, base = node
    port = int(base.rsplit(":", 1)[1])
    key = await _tenant(base)
    seconds = HEAD_TIMEOUT_S * 2 + 4
    attackers = [_attack("slow", port, f"127.0.0.{2 + i}", 10_000, seconds, "--ramp", "2") for i in range(2)]
    await asyncio.sleep(2)  # the connections pile up
    probes, lived = await asyncio.gather(_probe(base, key, seconds - 3), _slow_heads(port, 20, seconds - 3 - HEAD_TIMEOUT_S))
    reports = [_report(a) for a in attackers]
    # every probe answered, within PROBE_TIMEOUT_S. Where the attackers have cores of their own,
    # 90 % of the probes within 1 s. On a 2-core host they share the node's cores (niced, they
    # were starved and opened too few connections), the node accepts ~10,000 connections a second
    # on what is left, and only 6 to 16 probes fit in the run: CI saw p90s of 1.16 s and 1.89 s,
    # the 2-core development VM 2.05 s, and one run's slowest of 8 took 3.08 s. With so few, the
    # p90 is the slowest probe, so there the median judges: within 3 s
    took = probes.took
    typical = _p90(took) < 1.0 if MANY_CORES else _pct(took, 0.5) < 3.0
    assert len(took) >= (10 if MANY_CORES else 6) and max(took) < PROBE_TIMEOUT_S and typical, (
        sorted(took)[-5:], len(took), probes.failures, sorted(probes.connects)[-3:], reports
    )
    assert sum(r["opened"] for r in reports) >= 20_000, reports
    # the node closes a slow head the head time after its accept (the attackers' own view of it is
    # late by their loops' lag, seconds on a busy host: measured here). The median judges the timer:
    # within 1 s of the head time where the attackers have cores of their own, 2 s on fewer. The
    # slowest judges that every head was closed, not how late: a front closing thousands of expired
    # heads at once, on 2 cores it shares with the attackers and this test's own loop, was seen
    # 1.47, 2.26 and 3.55 s late. Without the limit a slow head lives until the client gives up
    typical_late, worst_late = (1.0, 2.0) if MANY_CORES else (2.0, HEAD_TIMEOUT_S * 1.5)
    assert len(lived) == 20 and _pct(lived, 0.5) < HEAD_TIMEOUT_S + typical_late, (sorted(lived), reports)
    assert max(lived) < HEAD_TIMEOUT_S + worst_late, (sorted(lived), reports)


async def test_endless_headers_are_cut_and_a_tenant_hardly_notices(node: tuple[Any, str]) -> None:
    proc, base = node
    port = int(base.rsplit(":", 1)[1])
    pids = fronts(proc.pid)
    key = await _tenant(base)
    # the p99 judges; where the attackers share the node's cores, a few hundred probes' p99 is a
    # few of their slowest: there the p90 judges
    pct = _p99 if MANY_CORES else _p90
    alone = pct((await _probe(base, key, 4)).took)
    before = _rss_mib(pids)
    # two endless headers at a time, each sent as fast as the socket takes it; a new one 50 ms
    # after each refusal (without the pause it is a flood of connections, another attack: on a
    # 2-core host the attackers' own CPU would be measured)
    attackers = [_attack("header", port, f"127.0.0.{4 + i}", 1, 6, "--pause", "0.05") for i in range(2)]
    await asyncio.sleep(0.5)
    beside = pct((await _probe(base, key, 4)).took)
    during = _rss_mib(pids)
    reports = [_report(a) for a in attackers]
    # each endless header is refused after its first 64 KiB (what the attacker wrote beyond that
    # sat in the kernel's socket buffers), so one after another every pause
    assert all(r["connections"] >= 20 for r in reports), reports
    assert during - before < 64, (before, during)  # the fronts hold none of them
    # within 2x of it alone, with a floor for a host's scheduling noise
    assert beside <= max(2 * alone, alone + (0.05 if MANY_CORES else 0.1)), (alone, beside)


async def test_held_unauthenticated_bodies_are_refused_unread(node: tuple[Any, str]) -> None:
    proc, base = node
    port = int(base.rsplit(":", 1)[1])
    pids = fronts(proc.pid)
    before = _rss_mib(pids)
    attacker = _attack("bodies", port, "127.0.0.6", 1000, 20)
    peak = before
    while attacker.poll() is None:  # read, 1000 such bodies would be a GiB
        peak = max(peak, _rss_mib(pids))
        await asyncio.sleep(0.05)
    report = _report(attacker)
    refused = report["statuses"].get("401", 0)
    reset = sum(n for status, n in report["statuses"].items() if status in ("ConnectionResetError", "BrokenPipeError", "IncompleteReadError"))
    # every one refused: the 401, or the reset of a connection closed with its body unread
    assert refused > 0 and refused + reset == 1000, report
    assert peak - before < 100, (before, peak)
    await asyncio.sleep(1)
    after = _rss_mib(pids)
    assert after <= before * 1.1, (before, after)


async def test_a_flood_of_keys_that_do_not_exist_is_turned_away_cheaply(node: tuple[Any, str]) -> None:
    _, base = node
    port = int(base.rsplit(":", 1)[1])
    seconds = 4
    report = _report(_attack("bogus", port, "127.0.0.7", 8, seconds))
    statuses = report["statuses"]
    # past the address's burst every answer is 429, given without a lookup: at most each front's
    # burst and rate of 401s, however fast or slow the attacker (counted, not timed: a slow host
    # makes fewer requests)
    limits = Settings.model_fields
    burst, rate = limits["auth_failure_burst"].default, limits["auth_failures_per_s"].default
    allowed = FRONTS * (burst + rate * (seconds + 1))
    assert 0 < statuses.get("401", 0) <= allowed and statuses.get("429", 0) > statuses.get("401", 0), statuses
