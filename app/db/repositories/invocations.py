"""Invocation records and the async queue: every query on the invocations table."""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Table, and_, delete, func, insert, literal_column, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import defer

from app.db.models import OUTPUT_SLICE, Invocation, InvocationOutput, Node, Tenant
from app.db.repositories.record_batches import RecordBatch, insert_statements
from app.queue.states import InvocationMode, InvocationStatus

QUEUED, RUNNING = InvocationStatus.QUEUED.value, InvocationStatus.RUNNING.value
# Named in every query by status: the status indexes cover async rows only (app/db/models.py),
# and a database uses such an index only for a query that says so itself, as a constant (a
# PostgreSQL plan made for any parameter value could not use it)
_ASYNC = Invocation.mode == literal_column(f"'{InvocationMode.ASYNC.value}'")
Buffer = bytes | bytearray | memoryview
_NO_DATA = (defer(Invocation.input, raiseload=True),)


@dataclass
class Recovered:
    """What `recover` did with the async work of lost nodes."""

    requeued: int = 0  # queued again for another attempt
    interrupted: int = 0  # its attempts were spent: ended `interrupted`
    cancelled: int = 0  # a cancel was asked, or its tenant was disabled: ended `cancelled`

    @property
    def total(self) -> int:
        return self.requeued + self.interrupted + self.cancelled


class InvocationRepository:
    def __init__(self, session: AsyncSession, tenant_id: str | None = None) -> None:
        self.session = session
        self.tenant_id = tenant_id

    # -- a tenant's view --------------------------------------------------------------------------
    async def get(self, invocation_id: str, *, data: bool = True) -> Invocation | None:
        """`data=False`: without its input (up to the body limit; a status poll read it whole,
        and on PostgreSQL as hex text at that). Its output is read by `output_slices`."""
        q = select(Invocation).where(Invocation.id == invocation_id, Invocation.tenant_id == self.tenant_id)
        if not data:
            q = q.options(*_NO_DATA)
        return await self.session.scalar(q)

    async def list(
        self, function: str | None, limit: int, status: str | None = None, after: tuple[datetime, str] | None = None,
        *, data: bool = True,
    ) -> Sequence[Invocation]:
        """Newest first (`data=False`: without inputs); `after` is the (created_at,
        id) of the last row of the previous page."""
        q = select(Invocation).where(Invocation.tenant_id == self.tenant_id)
        if not data:
            q = q.options(*_NO_DATA)
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

    async def count_async(self, status: InvocationStatus) -> int:
        q = select(func.count()).select_from(Invocation).where(
            Invocation.tenant_id == self.tenant_id, _ASYNC, Invocation.status == status.value
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
            .values(status=InvocationStatus.CANCELLED.value, ended_at=now, input=None, output_bytes=0, cancel_requested=True)
        )
        return res.rowcount == 1  # type: ignore[attr-defined]

    async def cancel_queued_of_tenant(self, now: datetime, reason: str) -> int:
        """End every queued invocation of the tenant `cancelled` with `reason` (its input deleted)."""
        res = await self.session.execute(
            update(Invocation)
            .where(Invocation.tenant_id == self.tenant_id, _ASYNC, Invocation.status == QUEUED)
            .values(status=InvocationStatus.CANCELLED.value, ended_at=now, input=None, output_bytes=0, error=reason)
        )
        return int(res.rowcount)  # type: ignore[attr-defined]

    async def request_cancel(self, invocation_id: str) -> bool:
        res = await self.session.execute(
            update(Invocation)
            .where(Invocation.id == invocation_id, Invocation.tenant_id == self.tenant_id, Invocation.status == RUNNING)
            .values(cancel_requested=True)
        )
        return res.rowcount == 1  # type: ignore[attr-defined]

    async def insert_batch(self, batch: RecordBatch) -> None:
        """A recorder's rows, their values built beforehand (app/db/repositories/record_batches.py);
        those of a shape it leaves to SQLAlchemy go as `insert_many`."""
        await insert_statements(self.session, batch)
        if batch.other:
            await self.insert_many(batch.other)

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
        # a disabled tenant's work is never claimed, by any node: its queued invocations end
        # `cancelled` in the transaction that disables it (cancel_queued_of_tenant), and a claim
        # that read them before that commit finds them gone in its update
        enabled = Invocation.tenant_id.in_(select(Tenant.id).where(Tenant.disabled.is_(False)))
        q = select(Invocation.id).where(_ASYNC, Invocation.status == QUEUED, enabled)
        if skip_tenants:
            q = q.where(Invocation.tenant_id.not_in(list(skip_tenants)))
        q = q.order_by(Invocation.created_at, Invocation.id).limit(limit)
        if self.session.get_bind().dialect.name == "postgresql":
            # the invocation rows only: the tenants' rows stay free for their writers' locks
            q = q.with_for_update(skip_locked=True, of=Invocation)
        ids = list((await self.session.scalars(q)).all())
        if not ids:
            return []
        await self.session.execute(
            update(Invocation)
            .where(Invocation.id.in_(ids), Invocation.status == QUEUED, enabled)
            .values(
                status=RUNNING, claimed_by=node_id, started_at=now, lease_expires_at=lease_until, attempt=Invocation.attempt + 1
            )
        )
        rows = await self.session.scalars(
            select(Invocation)
            .where(Invocation.id.in_(ids), Invocation.status == RUNNING, Invocation.claimed_by == node_id)
            .order_by(Invocation.created_at, Invocation.id)
            .execution_options(populate_existing=True)
        )
        return list(rows.all())

    async def tenant_of(self, invocation_id: str) -> str | None:
        return await self.session.scalar(select(Invocation.tenant_id).where(Invocation.id == invocation_id))

    async def finish(self, invocation_id: str, node_id: str, attempt: int, values: dict[str, Any]) -> bool:
        """End a running invocation this node holds in this attempt; False if it was taken from
        us meanwhile (its node was taken for dead and the work queued again). `values` are the
        record's columns, and `output` the stdout to keep (stored in slices)."""
        values = dict(values)
        output: Buffer | None = values.pop("output", None)
        if output is not None:
            values["output_bytes"] = len(output)
        res = await self.session.execute(
            update(Invocation)
            .where(
                Invocation.id == invocation_id, Invocation.status == RUNNING, Invocation.claimed_by == node_id,
                Invocation.attempt == attempt,
            )
            .values(lease_expires_at=None, input=None, **values)
        )
        if res.rowcount != 1:  # type: ignore[attr-defined]
            return False
        if output:
            await self._store_output(invocation_id, output)
        return True

    async def _store_output(self, invocation_id: str, output: Buffer) -> None:
        """A statement a slice, each bound as a view: the drivers copy one slice at a time (bound
        whole, SQLite's bind and record and psycopg's dump and libpq's buffer each held it all)."""
        view = memoryview(output).cast("B")
        await self.session.execute(delete(InvocationOutput).where(InvocationOutput.invocation_id == invocation_id))
        for idx, start in enumerate(range(0, len(view), OUTPUT_SLICE)):
            await self.session.execute(
                insert(InvocationOutput).values(invocation_id=invocation_id, idx=idx, data=view[start : start + OUTPUT_SLICE])
            )

    async def output_slice(self, invocation_id: str, idx: int) -> bytes | None:
        """Slice `idx` of a stored output (None past its end, or once it expired); the caller
        checked the invocation is its tenant's."""
        return await self.session.scalar(
            select(InvocationOutput.data).where(InvocationOutput.invocation_id == invocation_id, InvocationOutput.idx == idx)
        )

    async def renew(
        self, node_id: str, ids: Sequence[str], lease_until: datetime
    ) -> tuple[builtins.list[str], builtins.list[str]]:
        """Extend this node's leases; returns the ids whose cancel was asked meanwhile, and those
        this node no longer holds (taken for lost and queued again: stop them here)."""
        if not ids:
            return [], []
        await self.session.execute(
            update(Invocation)
            .where(Invocation.id.in_(list(ids)), Invocation.status == RUNNING, Invocation.claimed_by == node_id)
            .values(lease_expires_at=lease_until)
        )
        q = select(Invocation.id, Invocation.cancel_requested, Invocation.status, Invocation.claimed_by).where(
            Invocation.id.in_(list(ids))
        )
        cancel, lost = [], []
        for inv_id, cancel_requested, status, claimed_by in (await self.session.execute(q)).all():
            if status == QUEUED or (status == RUNNING and claimed_by != node_id):  # (one that ended is ending here)
                lost.append(inv_id)
            elif cancel_requested:
                cancel.append(inv_id)
        return cancel, lost

    async def recover(
        self, now: datetime, *, node_id: str | None = None, dead_seen_before: datetime | None = None, alive: str | None = None
    ) -> Recovered:
        """The async work of lost nodes: this node's own claims (`node_id`: at its start, from a
        previous life, or at its stop), else anyone's whose lease ran out or whose node was last
        seen before `dead_seen_before` (but `alive`, the caller, which just beat: its own row may
        look old after its loop stood still). Each is queued again while it has attempts left, else
        ends `interrupted`; one whose cancel was asked, or whose tenant is disabled, ends
        `cancelled`. Row by row (a dead node held at most its slots), each update guarded by the
        claim it read, so two nodes recovering at once take each row once."""
        if node_id is not None:
            cond = Invocation.claimed_by == node_id
        else:
            lost = Invocation.lease_expires_at < now
            if dead_seen_before is not None:
                dead = select(Node.id).where(Node.last_seen < dead_seen_before)
                if alive is not None:
                    dead = dead.where(Node.id != alive)
                lost = or_(lost, Invocation.claimed_by.in_(dead))
            cond = lost
        q = (
            select(
                Invocation.id, Invocation.claimed_by, Invocation.attempt, Invocation.max_attempts, Invocation.started_at,
                Invocation.lost_attempts, Invocation.cancel_requested, Tenant.disabled,
            )
            .join(Tenant, Tenant.id == Invocation.tenant_id)
            .where(_ASYNC, Invocation.status == RUNNING, cond)
        )
        if self.session.get_bind().dialect.name == "postgresql":
            q = q.with_for_update(skip_locked=True, of=Invocation)  # another node recovers these now
        done = Recovered()
        for inv_id, node, attempt, max_attempts, started_at, earlier, cancel_requested, disabled in (await self.session.execute(q)).all():
            history = [*(earlier or []), {
                "attempt": attempt, "node": node, "started_at": started_at.isoformat() if started_at else None,
                # a sweep's clock is read before its query: a claim made in between is not lost before it began
                "lost_at": (max(now, started_at) if started_at else now).isoformat(),
            }]
            if cancel_requested or disabled:
                why = "its cancel was asked" if cancel_requested else "its tenant is disabled"
                values: dict[str, Any] = dict(
                    status=InvocationStatus.CANCELLED.value, ended_at=now, lease_expires_at=None, input=None, output_bytes=0,
                    error=f"its node ({node}) was lost during attempt {attempt}, and {why}: not run again",
                )
            elif attempt < max_attempts:
                values = dict(status=QUEUED, claimed_by=None, started_at=None, lease_expires_at=None)
            else:
                values = dict(
                    status=InvocationStatus.INTERRUPTED.value, ended_at=now, lease_expires_at=None, input=None, output_bytes=0,
                    error=f"its node ({node}) stopped before it finished, in attempt {attempt} of {max_attempts}: "
                    "no attempts are left, it is not run again",
                )
            res = await self.session.execute(
                update(Invocation)
                .where(Invocation.id == inv_id, Invocation.status == RUNNING, Invocation.claimed_by == node,
                       Invocation.attempt == attempt)
                .values(lost_attempts=history, **values)
            )
            if res.rowcount != 1:  # type: ignore[attr-defined]
                continue  # ended or taken meanwhile
            if values["status"] == QUEUED:
                done.requeued += 1
            elif values["status"] == InvocationStatus.CANCELLED.value:
                done.cancelled += 1
            else:
                done.interrupted += 1
        return done

    async def expire_outputs(self, before: datetime) -> int:
        """Outputs of async invocations, and every invocation's stderr tail, ended before `before`."""
        expired = (Invocation.mode == InvocationMode.ASYNC.value, Invocation.ended_at < before, Invocation.output_bytes.is_not(None))
        await self.session.execute(
            delete(InvocationOutput).where(InvocationOutput.invocation_id.in_(select(Invocation.id).where(*expired)))
        )
        res = await self.session.execute(update(Invocation).where(*expired).values(output_bytes=None))
        await self.session.execute(
            update(Invocation).where(Invocation.ended_at < before, Invocation.stderr_tail.is_not(None)).values(stderr_tail=None)
        )
        return int(res.rowcount)  # type: ignore[attr-defined]

    async def delete_ended_before(self, before: datetime) -> int:
        """Records of invocations that ended before `before`."""
        res = await self.session.execute(delete(Invocation).where(Invocation.ended_at < before))
        return int(res.rowcount)  # type: ignore[attr-defined]

    async def queued_total(self) -> int:
        q = select(func.count()).select_from(Invocation).where(_ASYNC, Invocation.status == QUEUED)
        return int(await self.session.scalar(q) or 0)
