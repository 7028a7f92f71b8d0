"""Per-tenant token bucket for `requests_per_second` (burst = 2 s worth)."""

from __future__ import annotations

import math
import time


class TokenBucket:
    __slots__ = ("rate", "capacity", "tokens", "stamp")

    def __init__(self, rate: float, burst_seconds: float = 2.0) -> None:
        self.rate = rate
        self.capacity = max(1.0, rate * burst_seconds)
        self.tokens = self.capacity
        self.stamp = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self) -> float:
        """Take one token. Returns 0 on success, else the seconds until one is available."""
        self._refill()
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate

    @staticmethod
    def retry_after(seconds: float) -> int:
        return max(1, math.ceil(seconds))
