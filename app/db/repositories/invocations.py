"""Invocation records and the async queue: every query on the invocations table."""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Table, and_, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import Invocation, Tenant
from app.queue.states import InvocationMode, InvocationStatus

QUEUED, RUNNING = InvocationStatus.QUEUED.value, InvocationStatus.RUNNING.value


class InvocationRepository:
    def __init__(self, session: AsyncSession, tenant_id: str | None = None) -> None:
        self.session = session
        self.tenant_id = tenant_id

    # -- a tenant's view --------------------------------------------------------------------------
    async def get(self, invocation_id: str) -> Invocation | None:
        q = select(Invocation).where(Invocation.id == invocation_id, Invocation.tenant_id == self.tenant_id)
        return await self.session.scalar(q)

    async def list(
        self, function: str | None, limit: int, status: str | None = None, after: tuple[datetime, str] | None = None
    ) -> Sequence[Invocation]:
        """Newest first; `after` is the (created_at, id) of the last row of the previous page."""
        q = select(Invocation).where(Invocation.tenant_id == self.tenant_id)
        if function is not None:
            q = q.where(Invocation.function == function)
        if status is not None:
            q = q.where(Invocation.status == status)
        if after is not None:
            t, i = after
            q = q.where(or_(Invocation.created_at < t, and_(Invocation.created_at == t, Invocation.id < i)))
        q = q.order_by(Invocation.created_at.desc(), Invocation.id.desc()).limit(limit)
        return (await self.session.scalars(q)).all()

    async def by_idempotency_key(self, key: str) -> Invocation | None:
        q = select(Invocation).where(Invocation.tenant_id == self.tenant_id, Invocation.idempotency_key == key)
        return await self.session.scalar(q)

    async def forget_idempotency_key(self, invocation_id: str) -> None:
        """Release a key whose window passed, so a new invocation may take it."""
        await self.session.execute(
            update(Invocation).where(Invocation.id == invocation_id).values(idempotency_key=None)
        )

    async def lock_tenant(self) -> None:
        """Serialize a tenant's submits across nodes (a row lock on PostgreSQL; SQLite has one writer)."""
        await self.session.execute(select(Tenant.id).where(Tenant.id == self.tenant_id).with_for_update())

    async def count_async(self, status: InvocationStatus) -> int:
        q = select(func.count()).select_from(Invocation).where(
            Invocation.tenant_id == self.tenant_id, Invocation.mode == InvocationMode.ASYNC.value, Invocation.status == status.value
        )
        return int(await self.session.scalar(q) or 0)

    async def add(self, inv: Invocation) -> Invocation:
        self.session.add(inv)
        await self.session.flush()
        return inv

    async def cancel_queued(self, invocation_id: str, now: datetime) -> bool:
        """queued -> cancelled, atomically: a claim that won the race leaves it running."""
        res = await self.session.execute(
            update(Invocation)
            .where(Invocation.id == invocation_id, Invocation.tenant_id == self.tenant_id, Invocation.status == QUEUED)
            .values(status=InvocationStatus.CANCELLED.value, ended_at=now, input=None, output=b"", cancel_requested=True)
        )
        return res.rowcount == 1  # type: ignore[attr-defined]

    async def request_cancel(self, invocation_id: str) -> bool:
        res = await self.session.execute(
            update(Invocation)
            .where(Invocation.id == invocation_id, Invocation.tenant_id == self.tenant_id, Invocation.status == RUNNING)
            .values(cancel_requested=True)
        )
        return res.rowcount == 1  # type: ignore[attr-defined]

    async def insert_many(self, rows: builtins.list[dict[str, Any]]) -> None:
        """Batch insert from the recorder (rows already carry their tenant_id)."""
        # Core executemany (the ORM bulk path costs ~10x more per row), one per shape of row:
        # records of synchronous and streamed calls carry different columns
        groups: dict[frozenset[str], builtins.list[dict[str, Any]]] = {}
        for row in rows:
            groups.setdefault(frozenset(row), []).append(row)
        for group in groups.values():
            # a mapped class's __table__ is typed as any FromClause; declaratively it is a Table
            await self.session.execute(insert(cast(Table, Invocation.__table__)), group)

    # -- the queue (node-wide, no tenant scope) ---------------------------------------------------
    async def claim(
        self, node_id: str, now: datetime, lease_until: datetime, limit: int, skip_tenants: Sequence[str]
    ) -> builtins.list[Invocation]:
        """Take up to `limit` of the oldest queued invocations for this node.

        PostgreSQL: `FOR UPDATE SKIP LOCKED`, so nodes claiming at once never take the same row.
        SQLite (one node): the conditional update below is the claim.
        """
        q = select(Invocation.id).where(Invocation.status == QUEUED)
        if skip_tenants:
            q = q.where(Invocation.tenant_id.not_in(list(skip_tenants)))
        q = q.order_by(Invocation.created_at, Invocation.id).limit(limit)
        if self.session.get_bind().dialect.name == "postgresql":
            q = q.with_for_update(skip_locked=True)
        ids = list((await self.session.scalars(q)).all())
        if not ids:
            return []
        await self.session.execute(
            update(Invocation)
            .where(Invocation.id.in_(ids), Invocation.status == QUEUED)
            .values(status=RUNNING, claimed_by=node_id, started_at=now, lease_expires_at=lease_until)
        )
        rows = await self.session.scalars(
            select(Invocation)
            .where(Invocation.id.in_(ids), Invocation.status == RUNNING, Invocation.claimed_by == node_id)
            .order_by(Invocation.created_at, Invocation.id)
            .execution_options(populate_existing=True)
        )
        return list(rows.all())

    async def finish(self, invocation_id: str, node_id: str, values: dict[str, Any]) -> bool:
        """End a running invocation this node holds; False if it was taken from us meanwhile."""
        res = await self.session.execute(
            update(Invocation)
            .where(Invocation.id == invocation_id, Invocation.status == RUNNING, Invocation.claimed_by == node_id)
            .values(lease_expires_at=None, input=None, **values)
        )
        return res.rowcount == 1  # type: ignore[attr-defined]

    async def renew(self, node_id: str, ids: Sequence[str], lease_until: datetime) -> builtins.list[str]:
        """Extend this node's leases; returns the ids whose cancel was asked meanwhile."""
        if not ids:
            return []
        await self.session.execute(
            update(Invocation)
            .where(Invocation.id.in_(list(ids)), Invocation.status == RUNNING, Invocation.claimed_by == node_id)
            .values(lease_expires_at=lease_until)
        )
        q = select(Invocation.id).where(Invocation.id.in_(list(ids)), Invocation.cancel_requested.is_(True))
        return list((await self.session.scalars(q)).all())

    async def interrupt(self, now: datetime, node_id: str | None = None) -> int:
        """End `interrupted` what a dead node was running: this node's own claims at its start,
        or anyone's whose lease ran out."""
        cond = Invocation.claimed_by == node_id if node_id is not None else Invocation.lease_expires_at < now
        res = await self.session.execute(
            update(Invocation)
            .where(Invocation.status == RUNNING, Invocation.mode == InvocationMode.ASYNC.value, cond)
            .values(
                status=InvocationStatus.INTERRUPTED.value,
                ended_at=now,
                lease_expires_at=None,
                input=None,
                output=b"",
                error="the node running this invocation stopped before it finished; it was not re-run",
            )
        )
        return int(res.rowcount)  # type: ignore[attr-defined]

    async def expire_outputs(self, before: datetime) -> int:
        res = await self.session.execute(
            update(Invocation)
            .where(Invocation.mode == InvocationMode.ASYNC.value, Invocation.ended_at < before, Invocation.output.is_not(None))
            .values(output=None)
        )
        return int(res.rowcount)  # type: ignore[attr-defined]

    async def queued_total(self) -> int:
        q = select(func.count()).select_from(Invocation).where(Invocation.status == QUEUED)
        return int(await self.session.scalar(q) or 0)
