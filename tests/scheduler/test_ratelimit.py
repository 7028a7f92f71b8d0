"""The tenant's token bucket."""

from __future__ import annotations

import pytest

from app.scheduler import ratelimit
from app.scheduler.ratelimit import TokenBucket


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(ratelimit.time, "monotonic", lambda: now[0])
    return now


def test_a_burst_is_two_seconds_of_rate_then_calls_wait_for_the_refill(clock: list[float]) -> None:
    b = TokenBucket(5)
    assert [b.take() for _ in range(10)] == [0.0] * 10
    assert b.take() == pytest.approx(0.2)
    clock[0] += 0.2
    assert b.take() == 0.0

