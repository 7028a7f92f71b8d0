"""Counts and observations of the invoke path, held in the process and added to their Prometheus
series when the front publishes (once a second and at each scrape, with its phase totals).

In a node of several fronts every write to a series goes to a memory-mapped file under a lock
(~7 µs on the 2-core VM), and a call made ten of them: its HTTP request counted and timed, its
invocation counted and timed, its wait and its guest's run timed (a histogram observation is two
writes: its bucket and its sum). Held here, a call costs a few dict updates, and a scrape of any
front sees another front's at most `PUBLISH_S` late.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from typing import Any

log = logging.getLogger(__name__)


class _Observed:
    __slots__ = ("bounds", "buckets", "total")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.buckets = [0] * len(bounds)
        self.total = 0.0


def _splittable(child: Any) -> bool:
    """A histogram child whose bucket and sum values can take a batch at once: its upper bounds,
    buckets and sum, as prometheus_client has kept them for years. Without them, each observation
    goes straight to the child."""
    return all(hasattr(child, a) for a in ("_upper_bounds", "_buckets", "_sum"))


class Pending:
    """Increments and observations for label children (`Metrics.child`), published later.
    One event loop per process uses it: no lock."""

    def __init__(self) -> None:
        self._counts: dict[Any, float] = {}
        self._observed: dict[Any, _Observed | None] = {}  # None: observed directly

    def inc(self, child: Any, amount: float = 1.0) -> None:
        self._counts[child] = self._counts.get(child, 0.0) + amount

    def observe(self, child: Any, value: float) -> None:
        if child in self._observed:
            held = self._observed[child]
        else:
            held = self._observed[child] = _Observed(list(child._upper_bounds)) if _splittable(child) else None
        if held is None:
            child.observe(value)
            return
        held.total += value
        held.buckets[bisect_left(held.bounds, value)] += 1  # the first bucket whose bound is >= value

    def publish(self) -> None:
        """Everything held, into its series; a series that fails (its file could not grow) is
        logged and the rest still published."""
        counts, self._counts = self._counts, {}
        for child, amount in counts.items():
            try:
                child.inc(amount)
            except Exception:
                log.exception("publishing a count failed")
        for child, held in self._observed.items():
            if held is None or not any(held.buckets):
                continue
            buckets, total = held.buckets, held.total
            held.buckets, held.total = [0] * len(buckets), 0.0
            try:
                for i, n in enumerate(buckets):
                    if n:
                        child._buckets[i].inc(n)
                child._sum.inc(total)
            except Exception:
                log.exception("publishing an observation failed")
