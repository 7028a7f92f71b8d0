"""The device inventory alone (app/scheduler/devices.py): placement by free budget, ceilings
configured and learned, start back-off, and its view."""

from __future__ import annotations

import pytest

from app.scheduler.devices import (
    BACKOFF_BASE_S,
    BACKOFF_MAX_S,
    Device,
    DeviceStatus,
    Inventory,
)

GIB = 1 << 30
OVERHEAD = GIB // 2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def inventory(*budgets: int, ceiling: int = 0, clock: Clock | None = None) -> Inventory:
    devices = [Device(i, str(i), b, f"gpu{i}", ceiling) for i, b in enumerate(budgets)]
    return Inventory(devices, OVERHEAD, clock or Clock())


def start(inv: Inventory, device: Device, cap: int = 0) -> None:
    inv.context_started(device)
    if cap:
        inv.bound(device, cap)


def test_place_picks_the_device_with_the_most_free_budget() -> None:
    inv = inventory(8 * GIB, 8 * GIB, 4 * GIB)
    start(inv, inv[0], 3 * GIB)  # 4.5 GiB left on 0, 8 on 1, 4 on 2
    assert inv.place(GIB) is inv[1]
    start(inv, inv[1], 5 * GIB)  # 2.5 GiB left on 1
    assert inv.place(GIB) is inv[0]
    assert inv.place(4 * GIB) is inv[0]  # 4 + 0.5 overhead fits only device 0's 4.5 GiB
    assert inv.place(5 * GIB) is None
    assert inv.could_ever_fit(7 * GIB) and not inv.could_ever_fit(8 * GIB)


def test_placement_spreads_over_equal_devices() -> None:
    inv = inventory(8 * GIB, 8 * GIB, 8 * GIB)
    chosen = []
    for _ in range(3):
        d = inv.place(GIB)
        assert d is not None
        start(inv, d, GIB)
        chosen.append(d.index)
    assert sorted(chosen) == [0, 1, 2]


def test_accounting_returns_to_zero() -> None:
    inv = inventory(8 * GIB)
    d = inv[0]
    start(inv, d, GIB)
    assert (d.contexts, d.committed_bytes) == (1, OVERHEAD + GIB)
    inv.context_ended(d, GIB)
    assert (d.contexts, d.committed_bytes) == (0, 0)


def test_a_cpu_node_is_one_unlimited_device() -> None:
    inv = Inventory.cpu(OVERHEAD)
    assert len(inv) == 1 and inv[0].visible_id is None and inv[0].budget_bytes == 0
    for _ in range(50):
        d = inv.place(100 * GIB)
        assert d is inv[0]
        start(inv, d, 100 * GIB)
    assert inv[0].free_bytes() is None and inv.could_ever_fit(1 << 50)


def test_configured_ceiling_stops_placement() -> None:
    inv = inventory(0, 0, ceiling=2)
    for _ in range(4):
        d = inv.place()
        assert d is not None
        start(inv, d)
    assert inv.place() is None
    assert [d.status(0).value for d in inv.devices] == ["at_ceiling", "at_ceiling"]
    assert inv.all_full()
    inv.context_ended(inv[1], 0)
    assert inv.place() is inv[1] and not inv.all_full()


def test_a_refusal_sets_the_ceiling_to_the_contexts_held() -> None:
    inv = inventory(0, 0)
    for _ in range(3):
        start(inv, inv[0])
    assert inv.learn_refusal(inv[0]) == 0.0
    assert inv[0].learned_ceiling == 3 and inv[0].ceiling == 3
    assert inv.place() is inv[1]
    inv.context_ended(inv[0], 0)  # a later, lower refusal lowers it; a higher never raises it
    inv.learn_refusal(inv[0])
    assert inv[0].ceiling == 2
    start(inv, inv[0])
    start(inv, inv[0])
    inv.learn_refusal(inv[0])
    assert inv[0].ceiling == 2


def test_the_lower_of_configured_and_learned_ceiling_holds() -> None:
    inv = inventory(0, ceiling=5)
    for _ in range(3):
        start(inv, inv[0])
    inv.learn_refusal(inv[0])
    assert inv[0].ceiling == 3
    inv2 = inventory(0, ceiling=2)
    for _ in range(2):
        start(inv2, inv2[0])
    inv2[0].learned_ceiling = 4
    assert inv2[0].ceiling == 2


def test_a_refusal_with_nothing_held_backs_off_instead() -> None:
    clock = Clock()
    inv = inventory(0, clock=clock)
    delay = inv.learn_refusal(inv[0])
    assert delay == pytest.approx(BACKOFF_BASE_S * 2)
    assert inv[0].ceiling == 0 and inv[0].status(clock.now) == DeviceStatus.BACKING_OFF


def test_back_off_grows_exponentially_is_capped_and_resets() -> None:
    clock = Clock()
    inv = inventory(0, 0, clock=clock)
    d = inv[0]
    delays = [inv.start_failed(d) for _ in range(12)]
    assert delays[:4] == pytest.approx([0.4, 0.8, 1.6, 3.2])
    assert max(delays) == BACKOFF_MAX_S and delays[-1] == BACKOFF_MAX_S
    assert d.status(clock.now) == DeviceStatus.BACKING_OFF
    assert inv.place() is inv[1]  # the other device still starts
    assert inv.usable()
    inv.start_failed(inv[1])
    assert inv.place() is None and not inv.usable()
    clock.now += BACKOFF_MAX_S + 0.01
    assert d.status(clock.now) == DeviceStatus.OK and inv.usable()
    inv.start_ok(d)
    assert d.start_failures == 0
    assert inv.start_failed(d) == pytest.approx(0.4)


def test_view_reports_each_device() -> None:
    clock = Clock()
    inv = inventory(8 * GIB, 8 * GIB, ceiling=1, clock=clock)
    start(inv, inv[0], GIB)
    inv.start_failed(inv[1])
    view = inv.view()
    assert [v["index"] for v in view] == [0, 1]
    assert view[0] == {
        "index": 0, "name": "gpu0", "status": "at_ceiling", "contexts": 1, "ceiling": 1, "configured_ceiling": 1,
        "learned_ceiling": 0, "committed_bytes": OVERHEAD + GIB, "budget_bytes": 8 * GIB, "start_failures": 0, "backoff_s": 0.0,
    }
    assert view[1]["status"] == "backing_off" and view[1]["start_failures"] == 1 and view[1]["backoff_s"] == pytest.approx(0.4)
