"""A front's time per call, phase by phase: the accumulator, its counters, and a real app's calls."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from app.observability import phases
from app.observability.metrics import Metrics
from app.observability.phase_metrics import CALLS, SECONDS, PhaseCounters
from app.observability.phases import Phase, add_ns, answered, lap, steps, totals
from tests.helpers import ROOT, deploy, new_tenant, wat


@pytest.fixture
def ticks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that moves one nanosecond per reading: a stretch costs what it reads, not what it waits."""
    clock = itertools.count(10**12)
    monkeypatch.setattr(phases, "clock", lambda: next(clock))


def _spent(before: tuple[int, ...], phase: Phase) -> int:
    return totals()[0][phase] - before[phase]


def test_a_lap_adds_to_its_phase_and_starts_the_next(ticks: None) -> None:
    before, calls = totals()
    t = lap(Phase.BODY, 0)
    assert _spent(before, Phase.BODY) == t
    nxt = lap(Phase.WATCH, t)
    assert nxt == t + 1 and _spent(before, Phase.WATCH) == 1
    answered(nxt)
    assert _spent(before, Phase.RESPOND) == 1 and totals()[1] == calls + 1
    assert _spent(before, Phase.AUTH) == 0


async def test_steps_times_each_step_of_a_coroutine_and_none_of_its_waits(ticks: None) -> None:
    async def batch() -> str:
        await asyncio.sleep(0.01)  # the loop runs others meanwhile
        await asyncio.sleep(0.01)
        return "written"

    before = totals()[0]
    assert await steps(Phase.WATCH, batch()) == "written"
    assert _spent(before, Phase.WATCH) == 3  # three steps of one reading each; the waits count nothing


async def test_steps_passes_on_errors_and_lets_the_coroutine_handle_its_cancellation() -> None:
    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("the database is gone")

    with pytest.raises(ValueError, match="gone"):
        await steps(Phase.WATCH, fails())

    started = asyncio.Event()

    async def stops_cleanly() -> str:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return "stopped"  # as a flush finishing its transaction would
        return "slept"

    async def flush() -> str:
        return await steps(Phase.WATCH, stops_cleanly())

    task = asyncio.get_running_loop().create_task(flush())
    await started.wait()
    task.cancel()
    assert await task == "stopped"


def _probe_clock(setting: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TENSORWASM_PHASE_CLOCK"} | {"PYTHONPATH": str(ROOT)}
    if setting is not None:
        env["TENSORWASM_PHASE_CLOCK"] = setting
    probe = "import time; from app.observability import phases; print(phases.CLOCK, phases.clock is time.thread_time_ns)"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)


def test_the_clock_is_wall_time_unless_the_process_starts_with_the_cpu_clock() -> None:
    assert _probe_clock(None).stdout.split() == ["wall", "False"]
    assert _probe_clock("cpu").stdout.split() == ["cpu", "True"]
    refused = _probe_clock("sundial")
    assert refused.returncode != 0 and "sundial" in refused.stderr


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


def test_counters_publish_what_was_added_since_they_last_did() -> None:
    add_ns(Phase.ADMIT, 7_000_000_000)  # before the counters: not theirs
    registry = CollectorRegistry()
    counters = PhaseCounters(registry)
    assert all(_value(registry, f"{SECONDS}_total", phase=p.label) == 0 for p in Phase)  # every phase, from the start
    add_ns(Phase.ADMIT, 2_000_000_000)
    add_ns(Phase.RECORD_WRITE, 500_000_000)
    answered(0)
    answered(0)
    counters.publish()
    assert _value(registry, f"{SECONDS}_total", phase="admit") == 2.0
    assert _value(registry, f"{SECONDS}_total", phase="record_write") == 0.5
    assert _value(registry, f"{CALLS}_total") == 2
    counters.publish()  # nothing new
    assert _value(registry, f"{SECONDS}_total", phase="admit") == 2.0 and _value(registry, f"{CALLS}_total") == 2


_FRONT = """
import sys
from prometheus_client import CollectorRegistry
from app.observability.phase_metrics import PhaseCounters
from app.observability.phases import Phase, add_ns, answered
counters = PhaseCounters(CollectorRegistry())
add_ns(Phase.ADMIT, int(sys.argv[1]))
for _ in range(int(sys.argv[2])):
    answered(0)
counters.publish()
"""


def test_one_scrape_of_any_front_shows_the_sum_over_the_fronts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    for admit_ns, calls in ((1_000_000_000, 3), (3_000_000_000, 4)):  # two fronts of a node
        subprocess.run([sys.executable, "-c", _FRONT, str(admit_ns), str(calls)], env=env, check=True, timeout=60)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    text = Metrics(multiprocess=True).render().decode()  # a third front's scrape
    found = {(s.name, s.labels.get("phase")): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert found[(f"{SECONDS}_total", "admit")] == 4.0
    assert found[(f"{SECONDS}_total", "auth")] == 0.0
    assert found[(f"{CALLS}_total", None)] == 7


def _phase_samples(text: str) -> tuple[dict[str, float], float]:
    seconds: dict[str, float] = {}
    calls = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == f"{SECONDS}_total":
                seconds[s.labels["phase"]] = s.value
            elif s.name == f"{CALLS}_total":
                calls = s.value
    return seconds, calls


async def test_a_one_process_apps_calls_are_timed_in_every_phase(client: httpx.AsyncClient, platform: Any) -> None:
    _, key = await new_tenant(client)
    assert (await deploy(client, key, "echo", wat("echo"))).status_code == 201
    before, calls_before = _phase_samples((await client.get("/metrics")).text)
    for _ in range(3):  # the first reads its key and binds a worker (waits: not timed); the others find both
        assert (await client.post("/v1/functions/echo/invoke", content=b"x", headers=key)).status_code == 200
    await platform.recorder.flush()  # their records' batch
    after, calls_after = _phase_samples((await client.get("/metrics")).text)
    assert set(after) == {p.label for p in Phase}
    assert [p.label for p in Phase if after[p.label] <= before[p.label]] == []
    assert calls_after - calls_before == 3
