"""The tenant's token bucket, including the runs a held lease pays for ahead and gives back."""

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


def test_paying_ahead_leaves_the_lower_half_and_what_is_given_back_returns(clock: list[float]) -> None:
    b = TokenBucket(5)  # 10 tokens
    assert b.take() == 0.0
    assert b.take_up_to(25, keep=b.capacity / 2) == 4  # 9 there, 5 kept for everyone else
    assert b.take_up_to(25, keep=b.capacity / 2) == 0
    assert [b.take() for _ in range(5)] == [0.0] * 5 and b.take() > 0
    b.give_back(4)
    assert [b.take() for _ in range(4)] == [0.0] * 4 and b.take() > 0
    b.give_back(100)
    assert b.tokens == b.capacity  # never past the burst
