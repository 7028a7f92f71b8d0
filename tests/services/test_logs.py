"""Function logs' rows from invocation records (app/services/logs.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from app.services.logs import rows_of_records

_T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)


def test_a_row_per_record_that_wrote_to_stderr_and_none_for_the_rest() -> None:
    base = {"tenant_id": "t", "function": "f", "version": 3, "created_at": _T0, "started_at": _T0 + timedelta(milliseconds=1)}
    records = [
        {**base, "id": "quiet", "stderr_tail": None, "duration_ms": 5.0},
        {**base, "id": "empty", "stderr_tail": "", "duration_ms": 5.0},
        {**base, "id": "spoke", "stderr_tail": "warn: ñ\n", "duration_ms": 5.0},
        {**base, "id": "ended", "stderr_tail": "x", "ended_at": _T0 + timedelta(seconds=9), "duration_ms": 1.0},
        {"tenant_id": "t", "function": "f", "id": "unstarted", "created_at": _T0, "stderr_tail": "y"},
    ]
    rows = {r["invocation_id"]: r for r in rows_of_records(records)}
    assert set(rows) == {"spoke", "ended", "unstarted"}
    # the end is its start plus its duration, unless the record says when it ended
    assert rows["spoke"]["at"] == _T0 + timedelta(milliseconds=6)
    assert rows["ended"]["at"] == _T0 + timedelta(seconds=9)
    assert rows["unstarted"]["at"] == _T0
    assert rows["spoke"]["size"] == len("warn: ñ\n".encode()) and rows["spoke"]["version"] == 3
