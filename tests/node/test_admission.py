"""The node's shared admission table (app/node/admission.py), through two mappings of one file as
two fronts hold it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.node.admission import AdmissionTable, Verdict


@pytest.fixture
def tables(tmp_path: Path) -> Iterator[tuple[AdmissionTable, AdmissionTable]]:
    made = AdmissionTable.create(tmp_path / "table", fronts=2, tenants=64, workers=8)
    other = AdmissionTable.attach(tmp_path / "table")
    yield made, other
    other.close()
    made.close()


def test_calls_in_flight_are_counted_over_every_front_up_to_the_limit(tables: tuple[AdmissionTable, AdmissionTable]) -> None:
    a, b = tables
    first = a.admit(0, "t1", rate=1000, limit=2)
    second = b.admit(1, "t1", rate=1000, limit=2)
    assert (first.verdict, second.verdict) == (Verdict.OK, Verdict.OK)
    assert b.admit(1, "t1", rate=1000, limit=2).verdict == Verdict.FULL
    assert a.admit(0, "t2", rate=1000, limit=2).verdict == Verdict.OK  # another tenant's own count
    a.leave(0, first.slot)
    assert b.admit(1, "t1", rate=1000, limit=2).verdict == Verdict.OK
    assert a.inflight("t1") == 2


def test_the_rate_is_one_bucket_for_the_node(tables: tuple[AdmissionTable, AdmissionTable]) -> None:
    a, b = tables
    # 2 a second: the bucket holds 4 (2 s of the rate), taken from either front
    verdicts = [(a if i % 2 else b).admit(i % 2, "t", rate=2, limit=100).verdict for i in range(5)]
    assert verdicts == [Verdict.OK] * 4 + [Verdict.RATE]
    refused = a.admit(0, "t", rate=2, limit=100)
    assert refused.verdict == Verdict.RATE and 0 < refused.retry_after <= 0.5
    assert a.take_rate("t", rate=2) > 0  # a name that does not exist is charged the same


def test_a_call_goes_to_the_shortest_queue_and_leaves_it(tables: tuple[AdmissionTable, AdmissionTable]) -> None:
    a, b = tables
    picks = [a.admit(0, "t", rate=1000, limit=10, workers=[3, 5]) for _ in range(3)]
    assert [(p.worker, p.depth) for p in picks] == [(3, 0), (5, 0), (3, 1)]
    assert (b.queued(3), b.queued(5)) == (2, 1)
    a.leave(0, picks[0].slot, picks[0].worker)
    assert b.queued(3) == 1
    a.move(0, 3, 5)  # a call sent again elsewhere
    assert (b.queued(3), b.queued(5)) == (0, 2)


def test_a_dead_fronts_counts_are_given_back_and_only_its_own(tables: tuple[AdmissionTable, AdmissionTable]) -> None:
    a, b = tables
    a.admit(0, "t", rate=1000, limit=10, workers=[1])
    a.admit(0, "t", rate=1000, limit=10, workers=[1])
    mine = b.admit(1, "t", rate=1000, limit=10, workers=[1])
    assert b.reclaim(0) == 2  # front 0 died: its two calls died with it
    assert (b.inflight("t"), b.queued(1)) == (1, 1)
    b.leave(1, mine.slot, mine.worker)
    b.leave(0, mine.slot, mine.worker)  # a late leave of the dead front's: nothing of others' is taken
    assert (b.inflight("t"), b.queued(1)) == (0, 0)


def test_an_entry_that_holds_nothing_is_reused_and_a_full_table_refuses(tmp_path: Path) -> None:
    table = AdmissionTable.create(tmp_path / "small", fronts=1, tenants=64, workers=1)
    try:
        held = [table.admit(0, f"t{i}", rate=1e9, limit=10) for i in range(64)]
        assert all(h.verdict == Verdict.OK for h in held)
        assert table.admit(0, "one-more", rate=1e9, limit=10).verdict == Verdict.TABLE_FULL
        table.leave(0, held[7].slot)  # nothing in flight and a full bucket: its entry carries nothing
        again = table.admit(0, "one-more", rate=1e9, limit=10)
        assert again.verdict == Verdict.OK and again.slot == held[7].slot
        assert table.inflight("t7") == 0 and table.inflight("t8") == 1
    finally:
        table.close()


def test_a_file_that_is_no_table_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "junk"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not an admission table"):
        AdmissionTable.attach(path)
