"""Invocation ids: version-7 UUIDs as 32 hex digits, ordered by their creation time."""

from __future__ import annotations

import time
import uuid

from app.db.ids import new_invocation_id


def test_an_id_is_a_version_7_uuid_in_32_lowercase_hex_digits() -> None:
    for _ in range(1000):
        i = new_invocation_id()
        assert len(i) == 32 and i == i.lower() and int(i, 16) >= 0
        u = uuid.UUID(i)
        assert u.version == 7 and u.variant == uuid.RFC_4122


def test_an_id_carries_its_creation_millisecond_and_later_ids_sort_after() -> None:
    before = time.time_ns() // 1_000_000
    first = new_invocation_id()
    after = time.time_ns() // 1_000_000
    assert before <= int(first[:12], 16) <= after  # the first 48 bits: Unix milliseconds
    time.sleep(0.002)
    later = [new_invocation_id() for _ in range(100)]
    assert all(first < x for x in later)


def test_ids_made_in_the_same_millisecond_differ() -> None:
    ids = [new_invocation_id() for _ in range(100_000)]
    assert len(set(ids)) == len(ids)
