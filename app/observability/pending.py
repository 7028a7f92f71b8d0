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


class Held:
    """A counter child's increments, held. The invoke path keeps these (`Pending.count`) and adds
    to `amount` itself: no dict step per call."""

    __slots__ = ("amount",)

    def __init__(self) -> None:
        self.amount = 0.0


class Observed:
    """A histogram child's observations, held (`Pending.histogram`): `add` one value."""

    __slots__ = ("bounds", "buckets", "total")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.buckets = [0] * len(bounds)
        self.total = 0.0

    def add(self, value: float) -> None:
        self.total += value
        self.buckets[bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value


class _Direct:
    """A histogram child whose parts cannot be reached: each value goes to it at once."""

    __slots__ = ("_child",)

    def __init__(self, child: Any) -> None:
        self._child = child

    def add(self, value: float) -> None:
        self._child.observe(value)


Adds = Observed | _Direct  # where `Pending.histogram` holds a child's observations


def _splittable(child: Any) -> bool:
    """A histogram child whose bucket and sum values can take a batch at once: its upper bounds,
    buckets and sum, as prometheus_client has kept them for years. Without them, each observation
    goes straight to the child."""
    return all(hasattr(child, a) for a in ("_upper_bounds", "_buckets", "_sum"))


class Pending:
    """Increments and observations for label children (`Metrics.child`), published later.
    One event loop per process uses it: no lock."""

    def __init__(self) -> None:
        self._counts: dict[Any, Held] = {}
        self._observed: dict[Any, Adds] = {}

    def count(self, child: Any) -> Held:
        """Where a counter child's increments are held (the same one for as long as this lives)."""
        held = self._counts.get(child)
        if held is None:
            held = self._counts[child] = Held()
        return held

    def histogram(self, child: Any) -> Adds:
        """Where a histogram child's observations are held (the same one for as long as this lives)."""
        held = self._observed.get(child)
        if held is None:
            held = self._observed[child] = Observed(list(child._upper_bounds)) if _splittable(child) else _Direct(child)
        return held

    def inc(self, child: Any, amount: float = 1.0) -> None:
        self.count(child).amount += amount

    def observe(self, child: Any, value: float) -> None:
        self.histogram(child).add(value)

    def publish(self) -> None:
        """Everything held, into its series; a series that fails (its file could not grow) is
        logged and the rest still published."""
        for child, count in self._counts.items():
            if not count.amount:
                continue
            amount, count.amount = count.amount, 0.0
            try:
                child.inc(amount)
            except Exception:
                log.exception("publishing a count failed")
        for child, held in self._observed.items():
            if not isinstance(held, Observed) or not any(held.buckets):
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
