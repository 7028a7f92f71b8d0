"""A fair slot limiter: at most `slots` holders at once, at most one per key (tenant).

A key's requests wait in arrival order (FIFO). When a slot frees, it goes to the key, among
those with a request waiting and none holding a slot, that was granted a slot least recently
(a key with nothing held or queued is forgotten, so it counts as never served); ties go to the
oldest waiting request. So a tenant that keeps a queue of heavy compiles takes its turn after
every other waiting tenant, and one tenant never holds more than one slot: another tenant's
compile waits for at most one slot to free, whatever the first queued.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class FairLimiter:
    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError("a limiter needs at least one slot")
        self.slots = slots
        self._queues: dict[str, deque[tuple[int, asyncio.Future[None]]]] = {}
        self._holding: set[str] = set()
        self._last_grant: dict[str, int] = {}
        self._arrivals = itertools.count()
        self._grants = itertools.count()

    @property
    def running(self) -> int:
        return len(self._holding)

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    @asynccontextmanager
    async def slot(self, key: str) -> AsyncIterator[None]:
        await self.acquire(key)
        try:
            yield
        finally:
            self.release(key)

    async def acquire(self, key: str) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (next(self._arrivals), fut)
        self._queues.setdefault(key, deque()).append(entry)
        self._dispatch()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(key)  # granted just as we were cancelled: hand the slot on
            else:
                q = self._queues.get(key)
                if q is not None and entry in q:
                    q.remove(entry)
                    if not q:
                        del self._queues[key]
                self._forget_idle(key)
                self._dispatch()
            raise

    def release(self, key: str) -> None:
        self._holding.discard(key)
        self._forget_idle(key)
        self._dispatch()

    def _forget_idle(self, key: str) -> None:
        if key not in self._holding and key not in self._queues:
            self._last_grant.pop(key, None)

    def _dispatch(self) -> None:
        while len(self._holding) < self.slots:
            best: tuple[int, int, str] | None = None
            for key, q in list(self._queues.items()):
                while q and q[0][1].done():  # cancelled while queued; its task cleans up too
                    q.popleft()
                if not q:
                    del self._queues[key]
                    continue
                if key in self._holding:
                    continue
                rank = (self._last_grant.get(key, -1), q[0][0], key)
                if best is None or rank < best:
                    best = rank
            if best is None:
                return
            key = best[2]
            q = self._queues[key]
            _, fut = q.popleft()
            if not q:
                del self._queues[key]
            self._holding.add(key)
            self._last_grant[key] = next(self._grants)
            fut.set_result(None)
