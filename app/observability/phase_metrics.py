"""The front's phase totals (app/observability/phases.py) as Prometheus counters.

They are published as increments since the last publication (`Metrics.publish`: once a second
and at each scrape), so a plain counter does the adding: in a node of several fronts each front's
increments go to the node's multiprocess directory and one scrape of any front shows their sum.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from app.observability import phases
from app.observability.phases import Phase

SECONDS = "tensorwasm_front_phase_seconds"
CALLS = "tensorwasm_front_phase_calls"


class PhaseCounters:
    def __init__(self, registry: CollectorRegistry) -> None:
        seconds = Counter(SECONDS, "A front's own time on the invoke path, by phase (CPU: no waits)", ["phase"], registry=registry)
        self.calls = Counter(CALLS, "Synchronous invoke calls answered, over which the phases are spread", registry=registry)
        self.by_phase = [seconds.labels(p.label) for p in Phase]  # every phase present from the start
        self._ns, self._calls = phases.totals()  # this registry counts from here on

    def publish(self) -> None:
        ns, calls = phases.totals()
        for counter, now, before in zip(self.by_phase, ns, self._ns, strict=True):
            if now > before:
                counter.inc((now - before) / 1e9)
        if calls > self._calls:
            self.calls.inc(calls - self._calls)
        self._ns, self._calls = ns, calls
