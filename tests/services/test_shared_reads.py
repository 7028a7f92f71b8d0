"""One read for the callers of a key that come while it runs (app/services/shared_reads.py)."""

from __future__ import annotations

import asyncio

import pytest

from app.services.shared_reads import SharedReads


async def test_callers_of_one_key_share_a_read_and_other_keys_get_their_own() -> None:
    reads: SharedReads[str, str] = SharedReads()
    started: list[str] = []
    go = asyncio.Event()

    async def read(key: str) -> str:
        started.append(key)
        await go.wait()
        return key.upper()

    calls = [asyncio.create_task(reads.read(k, lambda k=k: read(k))) for k in ("a", "a", "b", "a")]  # type: ignore[misc]
    for _ in range(5):  # each task asks, and each read starts
        await asyncio.sleep(0)
    assert started == ["a", "b"] and len(reads) == 2
    go.set()
    assert await asyncio.gather(*calls) == ["A", "A", "B", "A"]
    assert len(reads) == 0
    assert await reads.read("a", lambda: read("a")) == "A" and started == ["a", "b", "a"]  # done: read again


async def test_a_caller_gone_leaves_the_read_to_the_others_and_a_failure_reaches_them_all() -> None:
    reads: SharedReads[str, int] = SharedReads()
    go = asyncio.Event()

    async def read() -> int:
        await go.wait()
        raise LookupError("gone")

    first, second = (asyncio.create_task(reads.read("k", read)) for _ in range(2))
    await asyncio.sleep(0)
    assert len(reads) == 1
    first.cancel()
    await asyncio.sleep(0)
    go.set()
    with pytest.raises(LookupError):
        await second
    assert first.cancelled() and len(reads) == 0

