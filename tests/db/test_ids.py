"""Invocation ids: version-7 UUIDs as 32 hex digits, ordered by their creation time."""

from __future__ import annotations

import subprocess
import sys
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


def test_request_ids_are_16_hex_digits_and_differ_across_batches() -> None:
    from app.db.ids import new_request_id

    ids = [new_request_id() for _ in range(10_000)]  # many batches
    assert all(len(i) == 16 and int(i, 16) >= 0 and i == i.lower() for i in ids)
    assert len(set(ids)) == len(ids)


def test_a_forked_child_never_hands_out_its_parents_remaining_ids() -> None:
    # in a process of its own: forking this one (threads of earlier tests in it) could deadlock
    script = """
import os
from app.db.ids import new_invocation_id, new_request_id

new_invocation_id(), new_request_id()  # a batch of each is drawn, most of it left
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # the child: its next ids, to the parent
    os.write(write, " ".join([new_invocation_id()[12:] for _ in range(50)] + [new_request_id() for _ in range(50)]).encode())
    os._exit(0)
os.close(write)
with os.fdopen(read) as f:
    child = set(f.read().split())
os.waitpid(pid, 0)
parent = {new_invocation_id()[12:] for _ in range(50)} | {new_request_id() for _ in range(50)}
print(len(child), len(child & parent))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert out == ["100", "0"]
