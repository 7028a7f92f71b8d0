"""The per-front budget of request bodies a tenant may hold at once."""

from __future__ import annotations

import pytest

from app.contract.errors import Rejected, RejectReason
from app.services.body_budget import BodyBudget


def test_holds_are_counted_per_tenant_and_given_back() -> None:
    budget = BodyBudget(1000)
    with budget.hold("a") as first:
        first.grow(600)
        with budget.hold("a") as second:
            with pytest.raises(Rejected) as err:
                second.grow(500)
            assert err.value.reason == RejectReason.BODY_BYTES and err.value.retry_after == 1
            assert "600 bytes" in err.value.message and "1000" in err.value.message
            second.grow(400)  # up to the limit exactly
            with budget.hold("b") as other:  # another tenant is not charged for a's bodies
                other.grow(900)
            assert budget.held("a") == 1000 and budget.held("b") == 0
        assert budget.held("a") == 600
    assert budget.held("a") == 0


def test_one_body_always_fits_when_the_tenant_holds_none() -> None:
    budget = BodyBudget(10)
    with budget.hold("a") as hold:
        hold.grow(10_000)  # the route's own size limit bounds it, not this budget
        with budget.hold("a") as next_one, pytest.raises(Rejected):
            next_one.grow(1)
    assert budget.held("a") == 0


def test_a_refused_grow_charges_nothing() -> None:
    budget = BodyBudget(100)
    with budget.hold("a") as first:
        first.grow(80)
        with budget.hold("a") as second:
            second.grow(10)
            with pytest.raises(Rejected):
                second.grow(20)
            assert second.bytes == 10 and budget.held("a") == 90
    assert budget.held("a") == 0
