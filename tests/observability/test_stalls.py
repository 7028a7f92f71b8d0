"""A process's stalls: its event loop's lag behind a timer, and its garbage collections."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

from prometheus_client import CollectorRegistry

from app.observability.stalls import TICK_S, StallWatch, stall_histograms


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


async def test_a_blocked_loop_is_seen_as_lag_and_collections_as_pauses() -> None:
    registry = CollectorRegistry()
    watch = StallWatch(*stall_histograms(registry, "probe"))
    watch.start()
    try:
        await _ticks(registry, 2)  # ticks of an idle loop: on time (a busy host may make one late)
        assert _value(registry, "probe_event_loop_lag_seconds_bucket", le="0.1") >= 1
        late = _value(registry, "probe_event_loop_lag_seconds_count") - _value(registry, "probe_event_loop_lag_seconds_bucket", le="0.1")
        lag = _value(registry, "probe_event_loop_lag_seconds_sum")
        time.sleep(0.3)  # a callback that holds the loop
        await _ticks(registry, _value(registry, "probe_event_loop_lag_seconds_count") + 2)
        # that tick, 0.2 s or more late (a busy host may make others late too, never fewer)
        assert _value(registry, "probe_event_loop_lag_seconds_count") - _value(registry, "probe_event_loop_lag_seconds_bucket", le="0.1") >= late + 1
        assert _value(registry, "probe_event_loop_lag_seconds_sum") - lag >= 0.2
        before = _value(registry, "probe_gc_pause_seconds_count", generation="2")
        gc.collect()
        # noted by the GC callback, observed by the next tick: a metric update may be what
        # started the collection, and its lock is not reentrant
        assert _value(registry, "probe_gc_pause_seconds_count", generation="2") == before
        await asyncio.sleep(TICK_S * 2)
        assert _value(registry, "probe_gc_pause_seconds_count", generation="2") >= before + 1
    finally:
        await watch.stop()
    assert watch._on_gc not in gc.callbacks  # a stopped watch costs collections nothing
    stopped = _value(registry, "probe_gc_pause_seconds_count", generation="2")
    gc.collect()
    assert _value(registry, "probe_gc_pause_seconds_count", generation="2") == stopped


async def _ticks(registry: CollectorRegistry, count: float) -> None:
    """Until the watch has observed `count` ticks (a busy host may delay them)."""
    deadline = time.monotonic() + 10
    while (registry.get_sample_value("probe_event_loop_lag_seconds_count") or 0) < count:
        assert time.monotonic() < deadline, "the watch stopped ticking"
        await asyncio.sleep(TICK_S)


class _LockedChild:
    """A histogram child whose update takes `lock`, as prometheus-client's do (in a front, one
    lock for every metric, not reentrant)."""

    def __init__(self, lock: threading.Lock, seen: list[float]) -> None:
        self.lock, self.seen = lock, seen

    def observe(self, value: float) -> None:
        with self.lock:
            self.seen.append(value)


class _LockedFamily:
    def __init__(self, lock: threading.Lock, seen: list[float]) -> None:
        self.child = _LockedChild(lock, seen)

    def labels(self, *_: str) -> _LockedChild:
        return self.child

    def observe(self, value: float) -> None:
        self.child.observe(value)


async def test_a_collection_during_a_metric_update_does_not_wait_for_its_lock() -> None:
    lock, seen = threading.Lock(), list[float]()
    family = _LockedFamily(lock, seen)
    watch = StallWatch(family, family)  # type: ignore[arg-type]
    watch.start()
    try:
        with lock:  # a metric update in progress when a collection starts
            collector = threading.Thread(target=gc.collect)
            collector.start()
            collector.join(timeout=5)
            assert not collector.is_alive(), "the GC callback waited for the metric lock"
        await asyncio.sleep(TICK_S * 3)
        assert seen  # the pause (and the ticks' lags) observed later, outside the collection
    finally:
        await watch.stop()
