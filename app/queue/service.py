"""Submit, cancel and read async invocations: the tenant-facing side of the queue."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.contract.messages import Principal
from app.db.ids import new_invocation_id
from app.db.models import CallbackDelivery, Invocation
from app.db.repositories.callbacks import CallbackRepository
from app.db.repositories.functions import FunctionRepository
from app.db.repositories.invocations import InvocationRepository
from app.db.repositories.tenants import TenantRepository
from app.db.write_turn import WriteTurn
from app.errors import Conflict, Forbidden, Gone, LimitReached, NotFound
from app.queue.states import InvocationMode, InvocationStatus
from app.services.callbacks import new_delivery
from app.services.functions import version_not_found
from app.settings import Settings

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]
StopLocal = Callable[[str], bool]  # stops an invocation if this node runs it


@dataclass
class Submitted:
    invocation: Invocation
    created: bool  # False: an Idempotency-Key repeat returned the earlier invocation
    callback: CallbackDelivery | None = None  # its X-Callback-Url delivery, when it has one


class AsyncInvocations:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], settings: Settings, clock: Clock, turn: WriteTurn | None = None) -> None:
        self.sessionmaker = sessionmaker
        self.settings = settings
        self.clock = clock
        # SQLite has one writer: this node's queue writes (submits, claims, ends) take turns with
        # each other and with the fronts' record batches (app/db/write_turn.py) instead of
        # meeting in SQLite's busy handler, whose sleeps cost milliseconds each and are not fair.
        # PostgreSQL needs no turn (row locks; several nodes).
        self.write_lock = turn or WriteTurn.for_url(sessionmaker.kw["bind"].url)

    async def submit(
        self, tenant: Principal, name: str, body: bytes, query: str, content_type: str, idempotency_key: str | None,
        args: list[str] | None = None, version: int | None = None, callback_url: str | None = None,
    ) -> Submitted:
        """`version`: the one it runs (X-Function-Version), else the one active when it runs."""
        async with self.write_lock, self.sessionmaker() as session:
            repo = InvocationRepository(session, tenant.id)
            tenants = TenantRepository(session)
            row = await tenants.lock(tenant.id)  # its submits take turns, on every node
            if row is None or row.disabled:  # a key cached by a front just before the change
                if row is None:
                    raise Forbidden("this tenant was deleted")
                raise Forbidden("this tenant is disabled; ask the operator to enable it", code="tenant_disabled")
            now = self.clock()
            if idempotency_key is not None:
                earlier = await repo.by_idempotency_key(idempotency_key)
                if earlier is not None:
                    if _aware(earlier.created_at) > now - timedelta(seconds=self.settings.idempotency_window_s):
                        return Submitted(earlier, created=False)  # the session closes without writing
                    await repo.forget_idempotency_key(earlier.id)
            fn = await FunctionRepository(session, tenant.id).get(name)
            if fn is None:
                raise NotFound.of(f"function {name!r}")
            if version is not None and await FunctionRepository(session, tenant.id).version_meta(fn, version) is None:
                raise version_not_found(name, version)
            queued = await repo.count_async(InvocationStatus.QUEUED)
            if queued >= tenant.quota.max_queued:
                raise LimitReached(
                    f"the tenant has {queued} async invocations waiting to start (its max_queued quota is "
                    f"{tenant.quota.max_queued}); retry once some have started",
                    code="queue_full", retry_after=1,
                )
            stored = await tenants.stored_bytes(tenant.id)
            if stored.total >= row.max_stored_bytes or stored.total + len(body) > row.max_stored_bytes:
                raise LimitReached(
                    f"the tenant stores {stored.total} bytes (async inputs and outputs {stored.async_data}, modules "
                    f"{stored.modules}, files {stored.files}); with this input of {len(body)} bytes that passes its max_stored_bytes quota of "
                    f"{row.max_stored_bytes}: fetch and let outputs expire (after {self.settings.output_retention_s:g} s), "
                    "or delete functions, then retry",
                    code="storage_quota_exceeded",
                )
            inv = Invocation(
                id=new_invocation_id(), tenant_id=tenant.id, function=name, version=version or fn.current_version, pinned_version=version,
                mode=InvocationMode.ASYNC.value, status=InvocationStatus.QUEUED.value, created_at=now,
                idempotency_key=idempotency_key, query_string=query, request_content_type=content_type, input=body,
                args=args, attempt=0, max_attempts=fn.max_attempts,  # its first claim makes it attempt 1
            )
            try:
                await repo.add(inv)
                callback = new_delivery(inv.id, tenant.id, callback_url, now) if callback_url else None
                if callback is not None:  # with its invocation: sent once it ended, by any node, after any restart
                    await CallbackRepository(session).add(callback)
                await session.commit()  # durable before the 202
            except IntegrityError:  # another node took the same key at the same moment
                await session.rollback()
                earlier = await repo.by_idempotency_key(idempotency_key or "")
                if earlier is None:
                    raise
                return Submitted(earlier, created=False)
            return Submitted(inv, created=True, callback=callback)

    async def get(self, tenant: Principal, invocation_id: str) -> Invocation:
        async with self.sessionmaker() as session:
            inv = await InvocationRepository(session, tenant.id).get(invocation_id)
        if inv is None:
            raise NotFound.of("invocation")
        return inv

    async def output(self, tenant: Principal, invocation_id: str, *, any_status: bool = False) -> Invocation:
        """An ended async invocation, for its stored stdout. One that did not succeed comes back
        as it is (kept output or not) for the caller to say how it ended, unless `any_status`
        asks for its stored stdout too."""
        inv = await self.get(tenant, invocation_id)
        if inv.mode != InvocationMode.ASYNC.value:
            raise NotFound("this invocation was not async: only async invocations store their output")
        if not InvocationStatus(inv.status).ended:
            raise Conflict(f"the invocation is {inv.status}; its output is ready once it ended", code="not_finished")
        if inv.status != InvocationStatus.SUCCEEDED.value and not any_status:
            return inv
        expires = _aware(inv.ended_at or inv.created_at) + timedelta(seconds=self.settings.output_retention_s)
        if inv.output_bytes is None or expires <= self.clock():
            raise Gone(f"the output was deleted after the retention of {self.settings.output_retention_s:g} s; the record remains")
        return inv

    async def output_slices(self, inv: Invocation) -> AsyncIterator[bytes]:
        """The stored stdout of an invocation `output` returned, a slice at a time, each read in a
        session of its own: a front holds a slice, not the output, and a slow client no connection."""
        left, idx = inv.output_bytes or 0, 0
        while left > 0:
            async with self.sessionmaker() as session:
                piece = await InvocationRepository(session).output_slice(inv.id, idx)
            if piece is None:  # the sweep took it meanwhile: the body ends short of its Content-Length
                log.warning("the output of invocation %s expired while it was read", inv.id)
                return
            left, idx = left - len(piece), idx + 1
            yield piece

    async def cancel(self, tenant: Principal, invocation_id: str, stop_local: StopLocal) -> Invocation:
        """queued: cancelled at once, never runs. running: its guest is stopped (here, or by the
        node that runs it at its next lease renewal) and the call waits for the end."""
        # the read, the write and the commit in one turn: a write begun in the turn and committed
        # after it would hold SQLite's lock while the next writer in turn waits for it
        async with self.write_lock, self.sessionmaker() as session:
            repo = InvocationRepository(session, tenant.id)
            inv = await repo.get(invocation_id, data=False)  # its input stays in the database
            if inv is None:
                raise NotFound.of("invocation")
            if InvocationStatus(inv.status).ended:
                raise Conflict(f"the invocation already ended ({inv.status})", code="already_finished")
            cancelled = await repo.cancel_queued(invocation_id, self.clock())
            if not cancelled:
                await repo.request_cancel(invocation_id)
            await session.commit()
        if cancelled:
            return await self.get(tenant, invocation_id)
        stop_local(invocation_id)
        deadline = asyncio.get_running_loop().time() + self.settings.queue_lease_s / 3 + 5
        while True:
            inv = await self.get(tenant, invocation_id)
            if InvocationStatus(inv.status).ended or asyncio.get_running_loop().time() > deadline:
                return inv
            await asyncio.sleep(0.05)


def _aware(t: datetime) -> datetime:
    """SQLite hands back naive datetimes; every stored time is UTC."""
    return t if t.tzinfo else t.replace(tzinfo=UTC)

