"""Node heartbeats: every query on the nodes table."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import delete, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import Node


class NodeRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def beat(self, node_id: str, host: str, now: datetime, *, started: bool = False) -> None:
        """This node is alive now; `started`: it (re)started now. One row per node id, so a node
        restarted on its data dir keeps its row."""
        values: dict[str, object] = {"last_seen": now, "host": host}
        if started:
            values["started_at"] = now
        res = await self.session.execute(update(Node).where(Node.id == node_id).values(**values))
        if res.rowcount == 0:  # type: ignore[attr-defined]
            self.session.add(Node(id=node_id, host=host, started_at=now, last_seen=now))
            await self.session.flush()

    async def list(self) -> Sequence[Node]:
        return (await self.session.scalars(select(Node).order_by(Node.id))).all()

    async def last_seen(self, node_id: str) -> datetime | None:
        """When `node_id` last wrote its heartbeat (None: no row, it never did or stopped cleanly)."""
        return (await self.session.scalars(select(Node.last_seen).where(Node.id == node_id))).one_or_none()

    async def live_count(self, seen_after: datetime) -> int:
        return len((await self.session.scalars(select(Node.id).where(Node.last_seen >= seen_after))).all())

    async def forget(self, node_id: str) -> None:
        """A node that stopped cleanly: nothing of it is left to recover."""
        await self.session.execute(delete(Node).where(Node.id == node_id))

    async def prune(self, seen_before: datetime) -> int:
        """Rows of nodes gone for good (not seen since `seen_before`)."""
        res = await self.session.execute(delete(Node).where(Node.last_seen < seen_before))
        return int(res.rowcount)  # type: ignore[attr-defined]
