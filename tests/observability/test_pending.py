"""Counts held by the invoke path (app/observability/pending.py) reach their series when published,
as if each had been written at once: buckets, sum and count of a histogram alike."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from app.observability.metrics import LATENCY_BUCKETS
from app.observability.pending import Pending


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample but the creation times, the sums rounded (they add up in another order)."""
    return {
        (x.name, tuple(sorted(x.labels.items()))): round(x.value, 9)
        for m in registry.collect() for x in m.samples if not x.name.endswith("_created")
    }


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_held_counts_and_observations_are_published_as_written_one_by_one() -> None:
    values = [0.0003, 0.0005, 0.002, 0.7, 31.0, 120.0, 0.0005]
    held, direct = CollectorRegistry(), CollectorRegistry()
    pending = Pending()
    for registry, hold in ((held, True), (direct, False)):
        calls = Counter("calls", "", ["tenant"], registry=registry).labels("a")
        seconds = Histogram("seconds", "", ["tenant"], buckets=LATENCY_BUCKETS, registry=registry).labels("a")
        for v in values:
            if hold:
                pending.inc(calls)
                pending.observe(seconds, v)
            else:
                calls.inc()
                seconds.observe(v)
    assert _value(held, "calls_total", tenant="a") == 0  # nothing written before the publication
    assert _value(held, "seconds_count", tenant="a") == 0
    pending.publish()
    assert _samples(held) == _samples(direct)
    assert _value(held, "calls_total", tenant="a") == len(values)
    assert _value(held, "seconds_bucket", tenant="a", le="0.0005") == 3  # a value on a bound counts in it
    pending.publish()  # nothing new: nothing added twice
    assert _value(held, "seconds_count", tenant="a") == len(values)
    assert _value(held, "seconds_sum", tenant="a") == pytest.approx(sum(values))


def test_a_histogram_whose_parts_it_cannot_reach_is_observed_at_once() -> None:
    class Plain:
        def __init__(self) -> None:
            self.seen: list[float] = []

        def observe(self, value: float) -> None:
            self.seen.append(value)

    child, pending = Plain(), Pending()
    pending.observe(child, 0.5)
    assert child.seen == [0.5]
    pending.publish()
    assert child.seen == [0.5]
