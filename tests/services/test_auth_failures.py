"""Failed authentications per client address (app/services/auth_failures.py)."""

from __future__ import annotations

from app.services.auth_failures import AuthFailures, address_key


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_address_may_fail_its_burst_then_waits_for_the_rate() -> None:
    clock = _Clock()
    failures = AuthFailures(rate=5, burst=20, clock=clock)
    for _ in range(20):
        assert failures.wait_s("198.51.100.7") == 0
        failures.failed("198.51.100.7")
    wait = failures.wait_s("198.51.100.7")
    assert 0.15 < wait <= 0.2 + 1e-9  # one failure's worth at 5 a second
    assert failures.wait_s("198.51.100.8") == 0  # another address is not held back
    clock.now += wait
    assert failures.wait_s("198.51.100.7") == 0
    clock.now += 10  # the bucket drains: a full burst again
    for _ in range(20):
        assert failures.wait_s("198.51.100.7") == 0
        failures.failed("198.51.100.7")


def test_no_rate_means_no_limit() -> None:
    failures = AuthFailures(rate=0, burst=1)
    for _ in range(1000):
        failures.failed("a")
    assert failures.wait_s("a") == 0


def test_addresses_are_bounded_least_recently_failed_first() -> None:
    failures = AuthFailures(rate=1, burst=1, max_addresses=3)
    for address in ("a", "b", "c"):
        failures.failed(address)
    failures.failed("a")  # now the most recent
    failures.failed("d")  # "b" is forgotten
    assert failures.wait_s("b") == 0
    assert failures.wait_s("a") > 0 and failures.wait_s("c") >= 0 and failures.wait_s("d") >= 0
    assert len(failures._tat) == 3


def test_an_ipv6_host_counts_by_its_64() -> None:
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key("192.0.2.1") == "192.0.2.1"
    assert address_key(None) == ""
