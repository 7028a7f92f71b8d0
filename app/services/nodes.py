"""The cluster as one node sees it: the `nodes` table read against this node's clock.

A node is alive when its heartbeat (app/queue/nodes.py) is younger than
TENSORWASM_NODE_DEAD_AFTER_S, the same bound the queue runner uses before it queues a node's
async work again, so what /readyz and `GET /v1/admin/nodes` call dead is what the queue treats
as dead.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from sqlalchemy.ext.asyncio import AsyncSession

from app.db.repositories.nodes import NodeRepository
from app.settings import Settings


class HeartbeatState(StrEnum):
    OK = "ok"
    STALE = "stale"  # older than the dead-after bound: other nodes queue this node's async work again
    MISSING = "missing"  # no row: the queue runner has not started, or the row was pruned


@dataclass(frozen=True)
class NodeView:
    id: str
    host: str
    started_at: datetime
    last_seen: datetime
    alive: bool


@dataclass(frozen=True)
class ClusterView:
    node: str  # this node's id
    heartbeat_age_s: float | None  # since this node's last heartbeat; None: it has no row
    heartbeat: HeartbeatState
    nodes_alive: int  # nodes (this one included) whose heartbeat is


def _dead_before(settings: Settings, now: datetime) -> datetime:
    return now - timedelta(seconds=settings.node_dead_after_s)


async def list_nodes(session: AsyncSession, settings: Settings, now: datetime) -> list[NodeView]:
    cutoff = _dead_before(settings, now)
    return [
        NodeView(id=n.id, host=n.host, started_at=n.started_at, last_seen=n.last_seen, alive=n.last_seen >= cutoff)
        for n in await NodeRepository(session).list()
    ]


async def cluster_view(session: AsyncSession, settings: Settings, now: datetime) -> ClusterView:
    repo = NodeRepository(session)
    node_id = settings.resolved_node_id
    seen = await repo.last_seen(node_id)
    cutoff = _dead_before(settings, now)
    return ClusterView(
        node=node_id,
        heartbeat_age_s=None if seen is None else round(max(0.0, (now - seen).total_seconds()), 3),
        heartbeat=HeartbeatState.MISSING if seen is None else HeartbeatState.OK if seen >= cutoff else HeartbeatState.STALE,
        nodes_alive=await repo.live_count(cutoff),
    )
