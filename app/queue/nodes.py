"""This node's heartbeat in the database (the `nodes` table), so other nodes can tell it died.

The queue runner beats every `TENSORWASM_NODE_HEARTBEAT_S` and, in the same round, recovers the
async work of nodes not seen for `TENSORWASM_NODE_DEAD_AFTER_S` (app/queue/runner.py). The time
written is this node's clock, compared with the reader's: nodes' clocks must agree well within
the dead-after bound (NTP does).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.repositories.nodes import NodeRepository
from app.settings import Settings

# rows of nodes not seen for this long are deleted by the sweep (their work was recovered long ago)
FORGET_AFTER = timedelta(days=1)


class NodeHeartbeat:
    def __init__(
        self, sessionmaker: async_sessionmaker[AsyncSession], settings: Settings, clock: Callable[[], datetime],
        write_lock: contextlib.AbstractAsyncContextManager[Any] | None = None,
    ) -> None:
        self.sessionmaker = sessionmaker
        self.node_id = settings.resolved_node_id
        self.host = socket.gethostname()[:255]
        self.clock = clock
        self.write_lock = write_lock or contextlib.nullcontext()  # SQLite: this node's writes take turns

    async def beat(self, *, started: bool = False) -> None:
        async with self.write_lock, self.sessionmaker() as session:
            await NodeRepository(session).beat(self.node_id, self.host, self.clock(), started=started)
            await session.commit()

    async def forget(self) -> None:
        """At a clean stop, after its work was handed back: no one waits for this node."""
        async with self.write_lock, self.sessionmaker() as session:
            await NodeRepository(session).forget(self.node_id)
            await session.commit()

    async def prune(self, session: AsyncSession) -> int:
        return await NodeRepository(session).prune(self.clock() - FORGET_AFTER)
