"""Function logs: what calls wrote to stderr, line by line, with the invocation, version and time.

Each call's stderr tail (as its record keeps it) becomes one row, written in the transaction
that records the call: by the recorder for synchronous and streamed calls (every front batches
its own, TENSORWASM_RECORD_FLUSH_INTERVAL_S), by the queue runner for async ones. Rows live in
the database, so every front and node sees every line; each tenant's are kept within
TENSORWASM_LOG_BYTES_PER_TENANT, its oldest calls' lines deleted first. A follower asks the
database every TENSORWASM_LOG_FOLLOW_POLL_S for rows past the last it saw (one indexed query).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.contract.messages import Principal
from app.db.models import FunctionLog, Invocation
from app.db.repositories import logs as log_rows
from app.db.repositories.functions import FunctionRepository
from app.db.repositories.logs import LogRepository
from app.errors import NotFound
from app.settings import Settings

_BATCH = 500  # rows a follower reads at once
LATE_S = 2.0  # how late a front's transaction may commit its rows behind another's and still be followed


@dataclass(frozen=True)
class LogLine:
    cursor: int  # the row (call) it came from: lines past it come later
    invocation_id: str
    version: int | None
    time: datetime  # when the call ended
    line: str


def row_of(tenant_id: str, function: str, invocation_id: str, version: int | None, at: datetime, text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    return {
        "tenant_id": tenant_id, "function": function, "invocation_id": invocation_id, "version": version, "at": at,
        "text": text, "size": len(text.encode()),
    }


def rows_of_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The log rows of invocation records as the recorder batches them (sync and stream calls)."""
    out = []
    for r in records:
        text = r.get("stderr_tail")
        if not text:
            continue  # most calls write nothing to stderr: no row, and no time to work out (~1 µs a record)
        ended = r.get("ended_at")
        if ended is None:
            started = r.get("started_at") or r.get("created_at") or datetime.now(UTC)
            ended = started + timedelta(milliseconds=r.get("duration_ms") or 0)
        row = row_of(r["tenant_id"], r["function"], r["id"], r.get("version"), ended, text)
        if row is not None:
            out.append(row)
    return out


async def write(session: AsyncSession, rows: list[dict[str, Any]], budget: int) -> None:
    """Add log rows in the caller's transaction and keep each of their tenants within `budget`."""
    if budget <= 0 or not rows:
        return
    await log_rows.append(session, rows)
    for tenant_id in {r["tenant_id"] for r in rows}:
        await log_rows.prune(session, tenant_id, budget)


async def write_async_end(session: AsyncSession, invocation_id: str, values: dict[str, Any], budget: int) -> None:
    """The log row of an async invocation that just ended (the queue runner's `on_finish`)."""
    if budget <= 0 or not values.get("stderr_tail"):
        return
    found = (await session.execute(select(Invocation.tenant_id, Invocation.function).where(Invocation.id == invocation_id))).first()
    if found is None:
        return
    row = row_of(found.tenant_id, found.function, invocation_id, values.get("version"), values.get("ended_at") or datetime.now(UTC),
                 values.get("stderr_tail"))
    await write(session, [row] if row else [], budget)


def lines_of(rows: Sequence[FunctionLog]) -> list[LogLine]:
    return [
        LogLine(r.id, r.invocation_id, r.version, r.at, line)
        for r in rows
        for line in r.text.splitlines()
    ]


class Logs:
    """Reading a function's logs, once or as they come."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], settings: Settings, flush: Callable[[], Awaitable[None]]) -> None:
        self.sessionmaker = sessionmaker
        self.settings = settings
        self.flush = flush  # this node's batched records (and their logs) written now

    async def _exists(self, session: AsyncSession, tenant: Principal, name: str) -> None:
        if await FunctionRepository(session, tenant.id).get(name) is None:
            raise NotFound.of(f"function {name!r}")

    async def recent(self, tenant: Principal, name: str, limit: int) -> list[LogLine]:
        """The last `limit` lines of the function's calls, oldest first."""
        await self.flush()
        async with self.sessionmaker() as session:
            await self._exists(session, tenant, name)
            rows = await LogRepository(session, tenant.id).newest(name, limit)
        return lines_of(rows)[-limit:]

    async def follow(self, tenant: Principal, name: str, limit: int) -> AsyncIterator[list[LogLine]]:
        """The last `limit` lines, then new ones as calls end, until the caller stops iterating.
        The function's existence is checked before the first yield (NotFound)."""
        first = await self.recent(tenant, name, limit)
        floor = first[-1].cursor if first else 0  # every row up to here was read
        yield first
        # Ids are handed out at insert, and two fronts' transactions may commit out of that order:
        # rows read within the last LATE_S stay remembered and the floor stays below them, so a
        # row committed late with a lower id is still found (once).
        seen: dict[int, float] = {}
        while True:  # a list each poll, empty when nothing came: the caller may send a keep-alive
            await asyncio.sleep(self.settings.log_follow_poll_s)
            async with self.sessionmaker() as session:
                rows = [r for r in await LogRepository(session, tenant.id).after(name, floor, _BATCH) if r.id not in seen]
            now = time.monotonic()
            seen.update((r.id, now) for r in rows)
            done = [i for i, t in seen.items() if now - t >= LATE_S]
            for i in done:
                del seen[i]
            floor = max([floor, *done])
            yield lines_of(rows)
