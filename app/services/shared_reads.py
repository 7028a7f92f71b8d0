"""One database read for every caller that misses a cache entry at once.

A loaded front's calls of one tenant all miss together when its entry is cold or expired (a
node just started, a refresh that failed): each read the database for the same row, hundreds at
a time. Here the first caller's read is shared by those that come while it runs; a caller that
goes away leaves it to the others. The key carries whatever makes a read stale (a cache's
generation), so a caller after a local change starts a read of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from functools import partial
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SharedReads(Generic[K, V]):
    __slots__ = ("_reads",)

    def __init__(self) -> None:
        self._reads: dict[K, asyncio.Future[V]] = {}

    def __len__(self) -> int:
        """The reads under way."""
        return len(self._reads)

    async def read(self, key: K, start: Callable[[], Awaitable[V]]) -> V:
        """The read under way for `key`, or `start()`'s; its result or its exception."""
        read = self._reads.get(key)
        if read is None:
            read = self._reads[key] = asyncio.ensure_future(start())
            read.add_done_callback(partial(self._done, key))
        return await asyncio.shield(read)

    def _done(self, key: K, read: asyncio.Future[V]) -> None:
        if self._reads.get(key) is read:
            del self._reads[key]
        if not read.cancelled():
            read.exception()  # retrieved: every caller may have gone (asyncio would log it)
