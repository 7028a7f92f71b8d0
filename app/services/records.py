"""Invocation records, buffered and written in batches off the call path."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.repositories.api_keys import ApiKeyRepository
from app.db.repositories.invocations import InvocationRepository
from app.db.repositories.record_batches import RecordBatch, record_batch
from app.db.write_turn import WriteTurn
from app.observability.phases import RECORD_WRITE, add_ns, clock, lap, steps
from app.services import logs

log = logging.getLogger(__name__)

# Rows whose values are built in one piece on the event loop (~8 µs a row on the 2-core VM,
# app/db/repositories/record_batches.py), calls run between pieces: a flush of 500 built whole
# held the loop ~4 ms there, five times a second in a loaded front, and every call of the front
# that came meanwhile waited for it. The pieces join one batch, written in one transaction.
_CHUNK = 50

# A stopping recorder lets a flush under way finish (up to STOP_WAIT_S), then keeps trying to
# write what it still holds (a database briefly out of reach) for up to STOP_FLUSH_S before it
# gives the rest up, logged: together within the time a node gives a front to stop
# (app/node/supervisor.py, FRONT_STOP_S).
STOP_WAIT_S = 10.0
STOP_FLUSH_S = 5.0


@dataclass
class _Landed:
    """What one flush committed before it failed or was cancelled."""

    keys: bool = False  # the keys' last uses
    rows: set[str] = field(default_factory=set)  # the ids of the records written, or given up (their tenant gone)


class InvocationRecorder:
    """Buffers invocation records and writes them in batches; callers never wait on the DB."""

    def __init__(
        self, sessionmaker: async_sessionmaker[AsyncSession], interval_s: float, batch: int, log_budget: int = 0, turn: WriteTurn | None = None
    ) -> None:
        self.sessionmaker = sessionmaker
        self._dialect = sessionmaker.kw["bind"].dialect
        self.turn = turn or WriteTurn(None, local=False)  # the node's turns at SQLite's write lock (its owner closes it)
        self.log_budget = log_budget  # bytes of function logs kept per tenant (app/services/logs.py); 0: none written
        self.interval_s = interval_s
        self.batch = batch
        self._pending: list[dict[str, Any]] = []
        self._touched: dict[str, datetime] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.dropped = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        # Let a flush in progress finish rather than cancel it mid-transaction: a cancelled write
        # can keep its SQLite connection's lock while the final flush below needs it.
        if self._task is not None:
            self._stopping = True
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout=STOP_WAIT_S)
            except TimeoutError:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        await self._last_flush()

    async def _last_flush(self) -> None:
        deadline = time.monotonic() + STOP_FLUSH_S
        while True:
            try:
                await self.flush()
                return
            except Exception:
                if time.monotonic() >= deadline:
                    self.dropped += len(self._pending)
                    log.exception("%d invocation records could not be written before this process stopped", len(self._pending))
                    self._pending = []
                    return
                log.warning("writing invocation records at shutdown failed; trying again", exc_info=True)
                await asyncio.sleep(0.5)

    def touch_key(self, key_id: str, when: datetime) -> None:
        """Note an API key's use; `last_used_at` is written with the next batch."""
        self._touched[key_id] = when

    def record(self, row: dict[str, Any]) -> None:
        self._pending.append(row)
        if len(self._pending) >= self.batch:
            self._wake.set()

    async def _loop(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            try:
                await self.flush()
            except Exception:
                log.exception("writing invocation records failed; will retry")

    async def flush(self) -> None:
        async with self._lock:  # a caller that wants what is held written waits for a flush under way
            if not self._pending and not self._touched:
                return
            touched, self._touched = self._touched, {}
            rows, self._pending = self._pending, []
            landed = _Landed()  # what this flush committed: never queued again
            try:
                batch = await self._prepare(rows)  # before the turn: the node's writers wait for none of it
                async with self.turn:
                    # Its CPU is the front's RECORD_WRITE phase: its own steps on the event loop
                    # (calls run while it waits), and what other threads spent meanwhile (SQLite's
                    # driver runs each connection in a thread of its own; other database work at
                    # that moment counts too, rare on the call path).
                    process, loop = time.process_time_ns(), time.thread_time_ns()
                    try:
                        await steps(RECORD_WRITE, self._write(touched, rows, batch, landed))
                    finally:
                        add_ns(RECORD_WRITE, max(0, (time.process_time_ns() - process) - (time.thread_time_ns() - loop)))
            except BaseException:
                # kept for the next try (a cancelled one too), bounded so a dead database cannot
                # exhaust memory; what was committed before the failure (a flush cancelled after
                # its commit, at a stop) is not: written again it would read as a duplicate
                if not landed.keys:
                    self._touched = touched | self._touched  # a newer use noted meanwhile wins
                unwritten = [r for r in rows if r["id"] not in landed.rows]
                keep = unwritten[-50_000:]
                self.dropped += len(unwritten) - len(keep)
                self._pending = keep + self._pending
                raise

    async def _prepare(self, rows: list[dict[str, Any]]) -> RecordBatch:
        """The rows' statements and values, a piece at a time with calls run between pieces."""
        batch = RecordBatch()
        for i in range(0, len(rows), _CHUNK):
            if i:
                await asyncio.sleep(0)
            t = clock()
            batch.extend(record_batch(rows[i : i + _CHUNK], self._dialect))
            lap(RECORD_WRITE, t)
        return batch

    async def _write(self, touched: dict[str, datetime], rows: list[dict[str, Any]], batch: RecordBatch, landed: _Landed) -> None:
        """Writes the keys' last uses, then the rows, noting in `landed` what was committed."""
        if touched:
            async with self.sessionmaker() as session:
                repo = ApiKeyRepository(session)
                for key_id, when in touched.items():
                    await repo.touch(key_id, when)
                await session.commit()
                landed.keys = True
        if not rows:
            return
        try:
            async with self.sessionmaker() as session:
                records = InvocationRepository(session)
                await records.insert_batch(batch)
                await logs.write(session, logs.rows_of_records(rows), self.log_budget)  # a call's stderr lines with its record
                await session.commit()
                landed.rows.update(r["id"] for r in rows)
        except IntegrityError:
            # A tenant deleted while its call ran: its record has nowhere to go. Write the
            # batch row by row so every other record still lands.
            await self._insert_each(rows, landed)

    async def _insert_each(self, rows: list[dict[str, Any]], landed: _Landed) -> None:
        for row in rows:
            try:
                async with self.sessionmaker() as session:
                    await InvocationRepository(session).insert_many([row])
                    await logs.write(session, logs.rows_of_records([row]), self.log_budget)
                    await session.commit()
                    landed.rows.add(row["id"])
            except IntegrityError:
                async with self.sessionmaker() as session:
                    there = await InvocationRepository(session).tenant_of(row["id"]) is not None
                if there:  # written before (its flush failed after the commit): nothing lost
                    landed.rows.add(row["id"])
                    continue
                self.dropped += 1
                landed.rows.add(row["id"])  # settled: not tried again if a later row's write fails
                log.info("dropped the record of invocation %s: its tenant no longer exists", row["id"])
