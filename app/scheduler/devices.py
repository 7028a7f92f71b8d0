"""Which device of the node a new worker context goes to: memory budgets, context ceilings and
start back-off per device (docs/architecture.md, "Devices"). Pure bookkeeping: no processes, no
event loop; the scheduler tells it what starts, binds and ends, and asks it where to place.

- A device admits a context while its contexts stay below its ceiling and the caps of its bound
  tenants plus a context overhead per context fit its memory budget (0 = no budget: CPU).
- The ceiling is the configured one (`TENSORWASM_MAX_CONTEXTS_PER_DEVICE`, 0 = none) or the one
  learned when the driver refused a context: the contexts the device held at that moment.
- A failed start makes the device wait 0.2 s * 2^n (n consecutive failures, capped at 30 s)
  before its next start; one successful start resets it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

BACKOFF_BASE_S = 0.2
BACKOFF_MAX_S = 30.0


class DeviceStatus(StrEnum):
    OK = "ok"  # may start contexts
    AT_CEILING = "at_ceiling"  # holds as many contexts as it may
    BACKING_OFF = "backing_off"  # a start failed recently; waits before the next


@dataclass
class Device:
    index: int  # this node's number for the device (metrics, admin views)
    visible_id: str | None  # what a worker's CUDA_VISIBLE_DEVICES names; None: no pinning (CPU)
    budget_bytes: int = 0  # device memory contexts may be promised; 0 = unlimited
    name: str = ""
    configured_ceiling: int = 0  # 0 = none configured
    learned_ceiling: int = 0  # 0 = none learned
    contexts: int = 0  # alive workers on it, starting ones included
    committed_bytes: int = 0  # per-context overhead of each + caps of bound tenants
    start_failures: int = 0  # consecutive
    next_start_at: float = 0.0  # monotonic time before which no start is tried

    @property
    def ceiling(self) -> int:
        """The lower of the configured and the learned ceiling; 0 = none."""
        limits = [c for c in (self.configured_ceiling, self.learned_ceiling) if c > 0]
        return min(limits) if limits else 0

    def free_bytes(self) -> int | None:
        """Budget not yet promised; None when the device has no budget."""
        return self.budget_bytes - self.committed_bytes if self.budget_bytes else None

    def fits(self, extra_bytes: int) -> bool:
        return not self.budget_bytes or self.committed_bytes + extra_bytes <= self.budget_bytes

    def status(self, now: float) -> DeviceStatus:
        if self.ceiling and self.contexts >= self.ceiling:
            return DeviceStatus.AT_CEILING
        if now < self.next_start_at:
            return DeviceStatus.BACKING_OFF
        return DeviceStatus.OK


class Inventory:
    def __init__(self, devices: list[Device], overhead_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        if not devices:
            raise ValueError("a node has at least one device")
        self.devices = devices
        self.overhead = overhead_bytes
        self.clock = clock

    @classmethod
    def cpu(cls, overhead_bytes: int, ceiling: int = 0) -> Inventory:
        """A CPU node: one device, no memory budget, no pinning."""
        return cls([Device(0, None, name="cpu", configured_ceiling=ceiling)], overhead_bytes)

    def __getitem__(self, index: int) -> Device:
        return self.devices[index]

    def __len__(self) -> int:
        return len(self.devices)

    # -- placement ------------------------------------------------------------------------------
    def can_start(self, device: Device, cap: int = 0) -> bool:
        """A new context with `cap` bytes bound to it may start on this device now."""
        return device.status(self.clock()) == DeviceStatus.OK and device.fits(self.overhead + cap)

    def place(self, cap: int = 0) -> Device | None:
        """The device with the most free budget that may start a context for `cap` bytes now."""
        candidates = [d for d in self.devices if self.can_start(d, cap)]
        if not candidates:
            return None
        # unlimited budgets (CPU, or none known) rank by fewest contexts; ties go to the lowest index
        return min(candidates, key=lambda d: (-(d.free_bytes() or 0) if d.budget_bytes else -(1 << 62), d.contexts, d.index))

    def could_ever_fit(self, cap: int) -> bool:
        """Some device's whole budget holds a context with this cap (else no eviction helps)."""
        return any(not d.budget_bytes or self.overhead + cap <= d.budget_bytes for d in self.devices)

    def all_full(self) -> bool:
        """No device can take one more context, for its ceiling or its budget (not a back-off:
        freeing a context would not help there)."""
        now = self.clock()
        return all(d.status(now) == DeviceStatus.AT_CEILING or not d.fits(self.overhead) for d in self.devices)

    def usable(self) -> bool:
        """Some device is not backing off: with all of them failing their starts, the node's
        devices are broken and it should take no new traffic."""
        now = self.clock()
        return any(d.status(now) != DeviceStatus.BACKING_OFF for d in self.devices)

    # -- accounting -----------------------------------------------------------------------------
    def context_started(self, device: Device) -> None:
        device.contexts += 1
        device.committed_bytes += self.overhead

    def context_ended(self, device: Device, cap: int) -> None:
        device.contexts -= 1
        device.committed_bytes -= self.overhead + cap

    def bound(self, device: Device, cap: int) -> None:
        """A tenant with `cap` bytes was bound on the device (negative: the binding failed)."""
        device.committed_bytes += cap

    # -- starts ---------------------------------------------------------------------------------
    def start_ok(self, device: Device) -> None:
        device.start_failures = 0
        device.next_start_at = 0.0

    def start_failed(self, device: Device) -> float:
        """Count a failed start; returns the seconds the device now waits before the next."""
        device.start_failures += 1
        delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**device.start_failures)
        device.next_start_at = self.clock() + delay
        return delay

    def learn_refusal(self, device: Device) -> float:
        """The driver refused a context on this device: its ceiling is what it holds now (the
        refused context already ended). With none held, the refusal cannot be a ceiling (another
        process, or no memory left), so it counts as a failed start. Returns the back-off (s)."""
        if device.contexts > 0:
            device.learned_ceiling = min(device.learned_ceiling or device.contexts, device.contexts)
            return 0.0
        return self.start_failed(device)

    # -- views ----------------------------------------------------------------------------------
    def view(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [
            {
                "index": d.index,
                "name": d.name,
                "status": d.status(now).value,
                "contexts": d.contexts,
                "ceiling": d.ceiling,
                "configured_ceiling": d.configured_ceiling,
                "learned_ceiling": d.learned_ceiling,
                "committed_bytes": d.committed_bytes,
                "budget_bytes": d.budget_bytes,
                "start_failures": d.start_failures,
                "backoff_s": round(max(0.0, d.next_start_at - now), 3),
            }
            for d in self.devices
        ]
