"""Keeps the per-node auth and function caches fresh for callers active recently.

Both caches hold entries for `TENSORWASM_CACHE_TTL_S` (the bound on how stale another node's
change may look here). Without this loop, a tenant calling less often than that paid the
database lookups on its call (~8 ms on the 2-core VM); with it, entries used within
`TENSORWASM_CACHE_KEEP_S` are re-read every half TTL, off the request path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.services.api_keys import AuthCache
from app.services.function_cache import FunctionCache

log = logging.getLogger(__name__)

STOP_WAIT_S = 5.0  # a refresh is a few reads: one that takes longer is cancelled


class CacheRefresher:
    def __init__(
        self, sessionmaker: async_sessionmaker[AsyncSession], auth: AuthCache, functions: FunctionCache, ttl_s: float, keep_s: float
    ) -> None:
        self.sessionmaker = sessionmaker
        self.auth = auth
        self.functions = functions
        self.interval_s = ttl_s / 2
        self.keep_s = keep_s
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """A refresh under way finishes first: cancelled inside its session, the connection's
        reset on the way back to the pool is cancelled too, and logged as an error."""
        if self._task is None:
            return
        self._stopping.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=STOP_WAIT_S)
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def refresh(self) -> None:
        async with self.sessionmaker() as session:
            await self.auth.refresh(session, self.keep_s)
        await self.functions.refresh(self.keep_s)

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.interval_s)
            if self._stopping.is_set():
                return
            try:
                await self.refresh()
            except Exception:  # entries then expire and calls read the database themselves
                log.exception("refreshing the auth and function caches failed")
