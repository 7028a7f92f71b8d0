"""What a node and its host saw during a benchmark run, read from the node's metrics (one
scrape per point) and the host's CPU times: the other tenant's slow calls and where they waited,
the processes' stalls, the workers replaced."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
from typing import Any, Self

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from app.bench.cpu import HostCpu
from app.observability.phase_metrics import CALLS, SECONDS
from app.observability.phases import Phase

SLOW_S = 0.05  # a bucket bound of the node's latency histograms
STALL_S = 0.01  # one of the stall histograms' (a call beside a flood takes 3-5 ms)


class _Reading:
    """Cumulative counts read at one point: a run's share is the reading after it minus the one
    before, field by field."""

    def __sub__(self, other: Self) -> Self:
        mine: Any = self
        return type(self)(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(mine)))


@dataclass(frozen=True)
class Slow(_Reading):
    """The other tenant's calls over SLOW_S: in all, waiting for a lease, in the guest's run
    (the rest of a slow call's time is in its front or on the way); and all its calls, as the
    node counted them (beside wrk's count, it shows whether wrk's requests reached the node)."""

    total: int = 0
    waiting: int = 0
    running: int = 0
    calls: int = 0


def scrape(client: httpx.Client) -> list[Sample]:
    """One scrape of the node's metrics."""
    return [s for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples]


def _matching(samples: list[Sample], name: str, labels: dict[str, str]) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def count(samples: list[Sample], family: str, **labels: str) -> int:
    """Observations of a histogram family, summed over the series that carry `labels`."""
    return int(_matching(samples, f"{family}_count", labels))


def over(samples: list[Sample], family: str, bound: float = SLOW_S, **labels: str) -> int:
    """Observations above `bound` (one of the family's bucket bounds)."""
    under = _matching(samples, f"{family}_bucket", {**labels, "le": str(bound)})
    return count(samples, family, **labels) - int(under)


def slow_calls(samples: list[Sample], tenant: str) -> Slow:
    def slow(name: str) -> int:
        return over(samples, f"tensorwasm_invocation_{name}_seconds", tenant=tenant)

    return Slow(slow("duration"), slow("wait"), slow("run"), count(samples, "tensorwasm_invocation_duration_seconds", tenant=tenant))


@dataclass(frozen=True)
class Split(_Reading):
    """Where a tenant's calls spent their time, as the node's histograms sum it (seconds):
    the whole call in its front, its wait for a lease, its guest's run in the worker."""

    calls: int = 0
    call_s: float = 0.0
    wait_s: float = 0.0
    run_s: float = 0.0

    def mean_us(self) -> tuple[float, float, float]:
        """Per call: in the node's call, waiting for a lease, in the guest (microseconds)."""
        n = self.calls or 1
        return 1e6 * self.call_s / n, 1e6 * self.wait_s / n, 1e6 * self.run_s / n


def split(samples: list[Sample], tenant: str) -> Split:
    def total(name: str) -> float:
        return _matching(samples, f"tensorwasm_invocation_{name}_seconds_sum", {"tenant": tenant})

    return Split(count(samples, "tensorwasm_invocation_duration_seconds", tenant=tenant), total("duration"), total("wait"), total("run"))


@dataclass(frozen=True)
class Stalls(_Reading):
    """What else happened during a flood run: timers the fronts' and the supervisor's event loops
    ran over STALL_S late, GC pauses over STALL_S (fronts and supervisor), and the host's share of
    CPU time busy and stolen by the hypervisor."""

    front_lags: int = 0
    supervisor_lags: int = 0
    gc_pauses: int = 0
    host: HostCpu = HostCpu()

    def describe(self) -> str:
        total = self.host.total_s or 1.0
        return f"{self.front_lags}/{self.supervisor_lags}/{self.gc_pauses}/{100 * self.host.busy_s / total:.0f}%/{100 * self.host.steal_s / total:.1f}%"


def stalls(samples: list[Sample], host: HostCpu) -> Stalls:
    def stalled(family: str) -> int:
        return over(samples, family, STALL_S)

    gc = stalled("tensorwasm_gc_pause_seconds") + stalled("tensorwasm_supervisor_gc_pause_seconds")
    return Stalls(stalled("tensorwasm_event_loop_lag_seconds"), stalled("tensorwasm_supervisor_event_loop_lag_seconds"), gc, host)


def worker_states(samples: list[Sample]) -> Counter[str]:
    """The node's worker processes by state now (starting, spare, binding, idle, busy)."""
    return Counter({s.labels["state"]: int(s.value) for s in samples if s.name == "tensorwasm_workers"})


def front_turns(samples: list[Sample]) -> int:
    """Turns waited for in the fronts so far (app/node/front_share.py): up to three a call."""
    return int(_matching(samples, "tensorwasm_front_turns_total", {}))


def replaced(samples: list[Sample]) -> Counter[str]:
    """Workers the node has replaced so far, by reason (each costs a context start)."""
    return Counter({s.labels["reason"]: int(s.value) for s in samples if s.name == "tensorwasm_worker_restarts_total"})


@dataclass(frozen=True)
class FrontPhases:
    """The fronts' own time by phase (app/observability/phases.py), summed over the fronts, and
    the calls it was spent on."""

    calls: int = 0
    seconds: tuple[float, ...] = (0.0,) * len(Phase)

    def __sub__(self, other: FrontPhases) -> FrontPhases:
        return FrontPhases(self.calls - other.calls, tuple(a - b for a, b in zip(self.seconds, other.seconds, strict=True)))

    def per_call_us(self) -> dict[Phase, float]:
        n = self.calls or 1
        return {p: 1e6 * self.seconds[p] / n for p in Phase}


def front_phases(samples: list[Sample]) -> FrontPhases:
    """A node that publishes no phases (older code) reads as none."""
    by_label = {p.label: p for p in Phase}
    seconds = [0.0] * len(Phase)
    calls = 0
    for s in samples:
        if s.name == f"{SECONDS}_total" and s.labels.get("phase") in by_label:
            seconds[by_label[s.labels["phase"]]] += s.value
        elif s.name == f"{CALLS}_total":
            calls += int(s.value)
    return FrontPhases(calls, tuple(seconds))
