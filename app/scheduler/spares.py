"""How many spares a node keeps, from what it measures (docs/architecture.md, "Spares and churn").
Pure bookkeeping with an injectable clock: the scheduler tells it of starts and of new tenants'
binds, and asks how long a start takes and how many spares to keep.

- A start takes the median of the recent starts (one slow start, the first after the fork
  server came up, does not move it); one start alone, that of each over the starts it queued
  behind at the driver plus one.
- New tenants arrive at a rate that decays with time constant `ARRIVAL_TAU_S`: each bind of a
  tenant that held no worker adds 1/tau, so k tenants within a short burst read as about k per
  second at once, and a node whose binds stop reads ~0 a few seconds later.
- Spares kept per device: (rate x start time + 1) over the node, spread over its devices, at
  least `warm_spares` and at most `max_warm_spares` each (`warm_spares` 0 keeps none at all).
- A node with room keeps some of it warm before anyone arrives: `spare_room_share` of the worker
  slots no tenant holds, spread over its devices, within the same bounds. Starts come at the
  driver's pace (one context after another per host), so new tenants arriving back to back bind
  at once only while spares made beforehand last; the share shrinks as tenants take the slots, so
  a full node keeps only `warm_spares`.
- A new tenant that finds no spare ready is a measurement too: the spares kept were fewer than
  the tenants arriving. The rate is raised to the one that keeps twice as many (`surge_rate`),
  so a burst doubles the spares under way at each such call instead of waiting for its binds to
  add up (the binds of a burst come only as fast as starts, and a rate read from them alone
  kept the starts under way too few for the burst's later tenants).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable

ARRIVAL_TAU_S = 1.0  # short: a burst is seen within a few binds, an idle node forgets it in seconds
START_SAMPLES = 16
NOISE = 0.25  # of a spare: less expected arrivals within a start than this keep no extra spare


class StartTimes:
    """Recent durations of successful worker starts (fork to ready), and of one start alone.

    The driver makes contexts one after another, so a start begun while k others were under way
    took up to (k + 1) times one start: a node's first spares, begun together, read as 1, 2, 3 ...
    times it. `typical` is how long starts took as they came (what spares kept ahead must
    cover); `alone` divides each by the starts it queued behind, for when the next one will be
    ready (a call waiting for it is refused only when that comes after its deadline). Where
    starts overlap rather than queue (the fork and setup of each, or a CPU node) `alone` reads
    low: a call may then wait up to its deadline in vain, but is never refused a start that
    would have served it.
    """

    def __init__(self, keep: int = START_SAMPLES) -> None:
        self._recent: deque[float] = deque(maxlen=keep)
        self._alone: deque[float] = deque(maxlen=keep)

    def add(self, seconds: float, ahead: int = 0) -> None:
        """A start that took `seconds`, begun while `ahead` others were under way."""
        self._recent.append(seconds)
        self._alone.append(seconds / (max(0, ahead) + 1))

    def typical(self) -> float | None:
        """The median of the recent starts; None before the first."""
        return statistics.median(self._recent) if self._recent else None

    def alone(self) -> float | None:
        """The median of the recent starts, each over the starts it queued behind plus one."""
        return statistics.median(self._alone) if self._alone else None


class ArrivalRate:
    """New tenants per second, an exponentially decaying count of their binds."""

    def __init__(self, tau_s: float = ARRIVAL_TAU_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.tau_s = tau_s
        self.clock = clock
        self._value = 0.0  # the rate at `_at`
        self._at = clock()

    def rate(self) -> float:
        return self._value * math.exp(-(self.clock() - self._at) / self.tau_s)

    def at_least(self, rate: float) -> None:
        """The rate is at least `rate` from now (decaying from there as before)."""
        if self.rate() < rate:
            self._value, self._at = rate, self.clock()

    def note(self) -> None:
        """A tenant that held no worker was bound one."""
        now = self.clock()
        self._value = self._value * math.exp(-(now - self._at) / self.tau_s) + 1 / self.tau_s
        self._at = now


def room_spares(unheld_slots: int, devices: int, share: float) -> int:
    """Spares per device kept from the node's room: `share` of the worker slots no tenant holds."""
    return math.floor(max(0.0, share) * max(0, unheld_slots) / max(1, devices) + 1e-9)  # 0.29 x 100 is 28.999...


def spare_target(
    rate: float, start_s: float | None, devices: int, warm_spares: int, max_warm_spares: int, room: int = 0,
) -> int:
    """Spares to keep per device: enough to bind the tenants that arrive while one start runs,
    plus one, or `room` (`room_spares`) if more, between `warm_spares` and `max_warm_spares` (the
    higher of the two bounds wins)."""
    if warm_spares <= 0:
        return 0
    arriving = 0
    if start_s is not None:
        node = 1 + math.ceil(max(0.0, rate * start_s - NOISE))  # a decaying rate never quite reaches 0
        arriving = math.ceil(node / max(1, devices))
    return max(warm_spares, min(max_warm_spares, max(arriving, room)))


def surge_rate(target: int, start_s: float, devices: int) -> float:
    """The arrival rate at which `spare_target` keeps twice `target` spares per device."""
    node = 2 * max(1, target) * max(1, devices)
    return (node - 1 + NOISE / 2) / start_s  # half the noise: clear of rounding at the ceiling
