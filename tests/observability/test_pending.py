"""Counts held by the invoke path (app/observability/pending.py) reach their series when published,
as if each had been written at once: buckets, sum and count of a histogram alike."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from app.observability.metrics import LATENCY_BUCKETS, Metrics
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


def test_the_invoke_paths_counts_held_by_label_values_reach_their_series() -> None:
    metrics = Metrics()
    for seconds, status in ((0.0003, 200), (0.004, 200), (0.2, 500)):
        metrics.waited("t", seconds)
        metrics.ran("t", seconds)
        metrics.invocation("t", "echo", "succeeded" if status == 200 else "guest_error", seconds, None)
        metrics.request("POST", "/v1/functions/{name}/invoke", status, seconds)
    metrics.waited("u", 0.001)  # another tenant's own series
    r = metrics.registry
    assert _value(r, "tensorwasm_invocations_total", tenant="t", function="echo", outcome="succeeded") == 0
    metrics.publish()
    assert _value(r, "tensorwasm_invocations_total", tenant="t", function="echo", outcome="succeeded") == 2
    assert _value(r, "tensorwasm_invocations_total", tenant="t", function="echo", outcome="guest_error") == 1
    for name in ("tensorwasm_invocation_wait_seconds", "tensorwasm_invocation_run_seconds", "tensorwasm_invocation_duration_seconds"):
        assert _value(r, f"{name}_count", tenant="t") == 3
        assert _value(r, f"{name}_bucket", tenant="t", le="0.005") == 2
        assert _value(r, f"{name}_sum", tenant="t") == pytest.approx(0.2043)
    assert _value(r, "tensorwasm_invocation_wait_seconds_count", tenant="u") == 1
    route = {"method": "POST", "route": "/v1/functions/{name}/invoke"}
    assert _value(r, "tensorwasm_http_requests_total", **route, status="200") == 2
    assert _value(r, "tensorwasm_http_requests_total", **route, status="500") == 1
    assert _value(r, "tensorwasm_http_request_duration_seconds_count", **route) == 3
    metrics.publish()  # nothing new: nothing added twice
    assert _value(r, "tensorwasm_invocations_total", tenant="t", function="echo", outcome="succeeded") == 2
    assert _value(r, "tensorwasm_http_request_duration_seconds_count", **route) == 3
