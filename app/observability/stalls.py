"""Stalls of a serving process: how late its event loop runs a timer, and how long its garbage
collections take. A stalled loop delays every call its process holds, and neither shows in any
one call's own timings, so both are histograms of their own (`StallWatch`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

STALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
TICK_S = 0.05  # 20 wakes a second: the lag of a loop stalled longer than this is seen whole


def stall_histograms(registry: CollectorRegistry, prefix: str = "tensorwasm") -> tuple[Histogram, Histogram]:
    """The loop-lag and GC-pause families, named `<prefix>_event_loop_lag_seconds` and
    `<prefix>_gc_pause_seconds` (the supervisor's registry gets its own prefix: its families are
    appended to the fronts' in one scrape, where a name may appear once)."""
    lag = Histogram(
        f"{prefix}_event_loop_lag_seconds", "How late the event loop ran a timer due now (a stall delays every call of the process)",
        buckets=STALL_BUCKETS, registry=registry,
    )
    pause = Histogram(
        f"{prefix}_gc_pause_seconds", "Garbage collection pauses, by generation", ["generation"], buckets=STALL_BUCKETS, registry=registry
    )
    return lag, pause


class StallWatch:
    """Observes this process's loop lag (a timer every TICK_S) and GC pauses (`gc.callbacks`).

    A collection can start inside any allocation, a metric's own update included, and
    prometheus-client holds a lock that is not reentrant while it updates one (in a front, one
    lock for every metric): a pause observed from the GC callback deadlocked such a front for
    good. So the callback only notes the pause, and the next tick observes it.
    """

    def __init__(self, lag: Histogram, pause: Histogram) -> None:
        self._lag = lag
        self._pauses = [pause.labels(str(g)) for g in range(3)]  # children made once: a callback runs per collection
        self._gc_started = 0.0
        self._noted: list[tuple[int, float]] = []  # pauses not yet observed: (generation, seconds)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        gc.callbacks.append(self._on_gc)

    async def stop(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._observe_pauses()

    async def _tick(self) -> None:
        observe = self._lag.observe
        while True:
            due = time.perf_counter() + TICK_S
            await asyncio.sleep(TICK_S)
            observe(max(0.0, time.perf_counter() - due))
            self._observe_pauses()

    def _observe_pauses(self) -> None:
        noted, self._noted = self._noted, []  # a collection meanwhile appends to `noted`, still read below
        for generation, seconds in noted:
            self._pauses[generation].observe(seconds)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """Takes no lock and calls nothing that might (see the class)."""
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._noted.append((info["generation"], time.perf_counter() - self._gc_started))
