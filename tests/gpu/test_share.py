"""The GPU-time share policy (app/gpu/share.py) on a fake clock: a simulated device that
time-slices its busy contexts evenly, as the driver does, and tenants whose contexts launch
kernels back to back."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from app.gpu.share import LINGER_S, MAX_HOLD_S, POLL_S, STALE_S, ContextShare, ShareTable

TICK = 0.0001


@dataclass
class Context:
    tenant: str
    share: ContextShare
    kernel_s: float
    gap_s: float
    left: float = 0.0  # kernel work left (seconds of a whole device)
    rest_until: float = 0.0
    launched_at: float = 0.0
    latencies: list[float] = field(default_factory=list)
    gpu_s: float = 0.0
    held: bool = False


def simulate(tmp_path: Path, tenants: dict[str, tuple[int, float, float, int]], seconds: float, policy: bool = True) -> dict[str, list[Context]]:
    """tenants: name -> (contexts, kernel seconds, gap seconds between kernels, weight)."""
    table = ShareTable.create(tmp_path / "share", rows=16)
    clock = [0.0]
    contexts: list[Context] = []
    for name, (n, kernel_s, gap_s, weight) in tenants.items():
        for _ in range(n):
            row = len(contexts)
            table.bind(row, name, device=0, weight=weight)
            contexts.append(Context(name, ContextShare(table, row, clock=lambda: clock[0]), kernel_s, gap_s))
    steps = int(seconds / TICK)
    poll = round(POLL_S / TICK)
    for step in range(steps):
        now = clock[0]
        for c in contexts:
            if c.left > 0 or now < c.rest_until:
                continue
            if c.held and step % poll:
                continue  # a held context looks again every POLL_S
            if not policy or c.share.ready(now):
                c.held = False
                c.left, c.launched_at = c.kernel_s, now
            else:
                c.held = True
        busy = [c for c in contexts if c.left > 0]
        for c in busy:  # the driver's time slices: each busy context gets an even part
            c.left -= TICK / len(busy)
            c.gpu_s += TICK / len(busy)
        clock[0] = now + TICK
        for c in busy:
            if c.left <= 1e-12:
                c.left = 0.0
                c.latencies.append(clock[0] - c.launched_at)
                c.rest_until = clock[0] + c.gap_s
                c.share.settle(clock[0])
    out: dict[str, list[Context]] = {}
    for c in contexts:
        out.setdefault(c.tenant, []).append(c)
    return out


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _gpu(cs: list[Context]) -> float:
    return sum(c.gpu_s for c in cs)


HEAVY = (4, 0.020, 0.0002, 1)  # four contexts of 20 ms kernels, back to back
SMALL = (1, 0.002, 0.0005, 1)  # one context of 2 ms kernels with a short gap between


def test_a_tenant_alone_is_never_held(tmp_path: Path) -> None:
    run = simulate(tmp_path, {"h": HEAVY}, 1.0)
    assert sum(c.share.held_s for c in run["h"]) == 0
    assert _gpu(run["h"]) == pytest.approx(1.0, abs=0.01)  # the device never idles for it


def test_without_the_policy_contexts_take_the_device(tmp_path: Path) -> None:
    """What the policy corrects: the one-context tenant's kernels take ~5x as long."""
    run = simulate(tmp_path, {"h": HEAVY, "v": SMALL}, 2.0, policy=False)
    assert _median(run["v"][0].latencies) > 4 * SMALL[1]


def test_equal_weights_share_the_device_by_tenant(tmp_path: Path) -> None:
    run = simulate(tmp_path, {"h": HEAVY, "v": SMALL}, 3.0)
    h, v = _gpu(run["h"]), _gpu(run["v"])
    assert 0.8 < v / h < 1.25, (v, h)
    assert v + h > 0.9 * 3.0
    # the small tenant's kernels overlap at most one of the heavy tenant's at a time
    assert _median(run["v"][0].latencies) <= 2.05 * SMALL[1]
    assert sum(c.share.held_s for c in run["v"]) < 0.1 * 3.0  # the tenant that wants less is seldom held


def test_weights_set_the_share(tmp_path: Path) -> None:
    run = simulate(tmp_path, {"h": HEAVY, "v": (1, 0.002, 0.0005, 3)}, 3.0)
    h, v = _gpu(run["h"]), _gpu(run["v"])
    # v wants ~80 % of the device (2 ms of each 2.5): with three times h's weight it gets at least
    # three times h's time (h's 20 ms kernels are the grain: it waits until it is due one whole)
    assert 2.4 < v / h < 6, (v, h)
    assert v + h > 0.8 * 3.0  # the device idles little: only while v pauses between kernels
    assert _median(run["v"][0].latencies) < 2.05 * SMALL[1]


@pytest.mark.parametrize("linger_s", [LINGER_S, 0.0])
def test_an_idle_tenant_stops_counting_after_its_linger(tmp_path: Path, linger_s: float) -> None:
    table = ShareTable.create(tmp_path / "share", rows=4, linger_s=linger_s)
    assert ShareTable.attach(table.path).linger_s == linger_s  # every worker reads the node's
    table.bind(0, "h", device=0, weight=1)
    table.bind(1, "v", device=0, weight=1)
    table.charge(0, 1.0, now=10.0)  # h has used far more than v
    table.finished(1, 0.001, now=10.0)  # v ended a period just now
    assert table.decide(0, now=10.0 + linger_s / 2).allowed is (linger_s == 0)
    assert table.decide(0, now=10.0 + LINGER_S * 2).allowed


def test_other_devices_and_cleared_or_stale_rows_do_not_count(tmp_path: Path) -> None:
    table = ShareTable.create(tmp_path / "share", rows=4)
    table.bind(0, "h", device=0, weight=1)
    table.bind(1, "v", device=1, weight=1)
    table.charge(0, 1.0, now=0.0)
    table.mark_busy(1, now=0.0)
    assert table.decide(0, now=0.001).allowed  # v is busy on another device
    table.bind(1, "v", device=0, weight=1)
    table.mark_busy(1, now=0.0)
    assert not table.decide(0, now=0.001).allowed
    assert table.decide(0, now=STALE_S + 1).allowed  # a busy row that old is a dead context's
    table.clear(1)
    assert table.decide(0, now=0.001).allowed


def test_a_hold_ends_after_its_bound(tmp_path: Path) -> None:
    table = ShareTable.create(tmp_path / "share", rows=4)
    table.bind(0, "h", device=0, weight=1)
    table.bind(1, "v", device=0, weight=1)
    table.charge(0, 100.0, now=0.0)
    table.mark_busy(1, now=0.0)  # v stays busy (and never charges)
    clock = [0.0]

    def sleep(s: float) -> None:
        clock[0] += s

    share = ContextShare(table, 0, clock=lambda: clock[0], sleep=sleep)
    share.launch()
    assert MAX_HOLD_S <= clock[0] < MAX_HOLD_S + 2 * POLL_S
    assert share.held_s == pytest.approx(clock[0])
    share.settle(clock[0] + 0.01)
    assert table.total(0) == pytest.approx(0.01)


def test_a_file_that_is_not_a_table_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other"
    path.write_bytes(b"\0" * 128)
    with pytest.raises(ValueError, match="not a GPU share table"):
        ShareTable.attach(path)
    table = ShareTable.create(tmp_path / "share", rows=3)
    assert ShareTable.attach(table.path).rows == 3


def test_a_killed_nodes_table_is_swept(tmp_path: Path) -> None:
    from app.gpu.share import sweep_tables, table_path

    mine = ShareTable.create(table_path(tmp_path), rows=2)
    gone = tmp_path / f"gpu-share-{2**22 + 7}.12345.0a1b2c3d"  # a pid past Linux's largest: no such process
    gone.write_bytes(b"")
    sweep_tables(tmp_path)
    assert mine.path.exists() and not gone.exists()
