"""The queue runner: claims queued async invocations from the database and runs them.

One per node. It claims the oldest queued work (FIFO per tenant) while it has room, never more
of one tenant than that tenant's `max_concurrency`, and runs each through the same scheduler
path as a synchronous call, so quotas and fairness are the same. A claim carries this node's id
and a lease it renews while the call runs; at start the node ends its own stale claims
`interrupted`, and every node ends claims whose lease expired (their node died) the same way.
Nothing is ever re-run. It depends on an executor and repositories only, so it can move into a
supervisor process unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.contract.errors import NoCapacity, Rejected
from app.db.models import Invocation
from app.db.repositories.invocations import InvocationRepository
from app.db.repositories.tenants import TenantRepository
from app.errors import NotFound
from app.queue.states import InvocationStatus
from app.services.principal import TenantPrincipal
from app.settings import Settings

log = logging.getLogger(__name__)


class Execution(Protocol):
    status: InvocationStatus
    version: int
    content_type: str
    duration_ms: float
    exit_code: int | None
    error: str | None
    stdout: bytes
    stderr_tail: str | None


Execute = Callable[[TenantPrincipal, str, str, bytes, str, str], Awaitable[Execution]]


class QueueRunner:
    def __init__(
        self, sessionmaker: async_sessionmaker[AsyncSession], settings: Settings, execute: Execute,
        clock: Callable[[], datetime], write_lock: contextlib.AbstractAsyncContextManager[Any] | None = None,
    ) -> None:
        self.sessionmaker = sessionmaker
        self.settings = settings
        self.execute = execute
        self.clock = clock
        self.node_id = settings.resolved_node_id
        self.write_lock = write_lock or contextlib.nullcontext()  # see AsyncInvocations.write_lock
        self.slots = settings.async_concurrency or settings.max_workers
        self.running: dict[str, asyncio.Task[None]] = {}
        self._tenant_of: dict[str, str] = {}
        self._principals: dict[str, tuple[float, TenantPrincipal | None]] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.started_count = 0
        self.backlog = 0  # queued async invocations in the database (every node's), as last counted
        self.on_counts: Callable[[int, int], object] | None = None  # (backlog, running) as they change
        self.start_delays: list[float] = []  # submit-to-start seconds, for the benchmark

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        async with self.sessionmaker() as session:
            n = await InvocationRepository(session).interrupt(self.clock(), node_id=self.node_id)
            await session.commit()
        if n:
            log.warning("%d async invocations were running when this node last stopped: ended interrupted", n)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._claim_loop()), loop.create_task(self._lease_loop()), loop.create_task(self._sweep_loop())]

    async def stop(self) -> None:
        """Stop claiming; what is running is cancelled and ends `interrupted` (never re-run)."""
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        calls = list(self.running.values())
        for t in calls:
            t.cancel()
        for t in calls:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        with contextlib.suppress(Exception):
            async with self.sessionmaker() as session:
                await InvocationRepository(session).interrupt(self.clock(), node_id=self.node_id)
                await session.commit()

    def wake(self) -> None:
        """Work was submitted on this node: look now rather than at the next poll."""
        self._wake.set()

    def stop_local(self, invocation_id: str) -> bool:
        """Cancel a call this node runs (its worker is killed by the scheduler); False if not here."""
        task = self.running.get(invocation_id)
        if task is None:
            return False
        task.cancel()
        return True

    # -- claiming -------------------------------------------------------------------------------
    async def _claim_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.queue_poll_s)
            self._wake.clear()
            try:
                while await self._claim_some():
                    pass
            except Exception:
                log.exception("claiming queued invocations failed; will retry")
                await asyncio.sleep(1)

    async def _claim_some(self) -> bool:
        room = self.slots - len(self.running)
        if room <= 0 or self._stopping:
            return False
        per_tenant = Counter(self._tenant_of.values())
        quotas = {tid: await self._limit(tid) for tid in per_tenant}
        async with self.write_lock, self.sessionmaker() as session:
            now = self.clock()  # inside the lock: a submit that held it is older than this claim
            full = [tid for tid, n in per_tenant.items() if n >= quotas[tid]]
            repo = InvocationRepository(session)
            rows = await repo.claim(self.node_id, now, now + timedelta(seconds=self.settings.queue_lease_s), room, full)
            # never more of one tenant than its max_concurrency: hand back the rest, untouched
            taken: list[Invocation] = []
            give_back: list[Invocation] = []
            for inv in rows:
                if inv.tenant_id not in quotas:
                    quotas[inv.tenant_id] = await self._limit(inv.tenant_id)
                if per_tenant[inv.tenant_id] >= quotas[inv.tenant_id]:
                    give_back.append(inv)
                else:
                    per_tenant[inv.tenant_id] += 1
                    taken.append(inv)
            for inv in give_back:
                inv.status, inv.claimed_by, inv.started_at, inv.lease_expires_at = InvocationStatus.QUEUED.value, None, None, None
            await session.commit()
        for inv in taken:
            self._launch(inv, now)
        return bool(taken) and not give_back

    async def _principal(self, tenant_id: str) -> TenantPrincipal | None:
        """The tenant and its quota, cached like the api's auth cache (changes apply within its TTL)."""
        hit = self._principals.get(tenant_id)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        async with self.sessionmaker() as session:
            t = await TenantRepository(session).get(tenant_id)
        p = TenantPrincipal.of(t) if t is not None else None
        self._principals[tenant_id] = (time.monotonic() + self.settings.cache_ttl_s, p)
        if len(self._principals) > 10_000:
            self._principals.clear()
        return p

    async def _limit(self, tenant_id: str) -> int:
        p = await self._principal(tenant_id)
        return p.quota.max_concurrency if p else 0

    def _launch(self, inv: Invocation, now: datetime) -> None:
        created = inv.created_at if inv.created_at.tzinfo else inv.created_at.replace(tzinfo=now.tzinfo)
        self.start_delays.append((now - created).total_seconds())
        del self.start_delays[:-10_000]
        self.started_count += 1
        task = asyncio.get_running_loop().create_task(self._run(inv))
        self.running[inv.id] = task
        self._tenant_of[inv.id] = inv.tenant_id

        self._publish()

        def done(_: asyncio.Task[None], key: str = inv.id) -> None:
            self.running.pop(key, None)
            self._tenant_of.pop(key, None)
            self._publish()
            self._wake.set()  # a slot is free

        task.add_done_callback(done)

    def _publish(self) -> None:
        if self.on_counts is not None:
            self.on_counts(self.backlog, len(self.running))

    # -- one invocation -------------------------------------------------------------------------
    async def _run(self, inv: Invocation) -> None:
        values: dict[str, Any]
        t0 = time.perf_counter()
        try:
            principal = await self._principal(inv.tenant_id)
            if principal is None:
                return  # deleted: its invocations went with it
            while True:
                try:
                    ex = await self.execute(principal, inv.function, inv.id, inv.input or b"", inv.query_string or "", inv.request_content_type or "")
                    break
                except (Rejected, NoCapacity) as exc:  # the tenant is busy on this node: wait, keep the claim
                    await asyncio.sleep(getattr(exc, "retry_after", 1) * 0.25)
            values = dict(
                status=ex.status.value, version=ex.version, duration_ms=ex.duration_ms, exit_code=ex.exit_code,
                error=ex.error, stderr_tail=ex.stderr_tail, output=bytes(ex.stdout), content_type=ex.content_type,
            )
        except asyncio.CancelledError:
            if self._stopping:
                raise  # the node stops: stop() ends it interrupted
            values = dict(status=InvocationStatus.CANCELLED.value, error="cancelled while running", output=b"",
                          duration_ms=(time.perf_counter() - t0) * 1000)
        except NotFound as exc:  # the function was deleted after the submit; any other domain error (its
            # module cannot be compiled on this node, the compiler is unavailable) is an internal error below
            values = dict(status=InvocationStatus.NOT_FOUND.value, error=exc.message, output=b"")
        except Exception as exc:
            log.exception("async invocation %s failed", inv.id)
            values = dict(status=InvocationStatus.INTERNAL_ERROR.value, error=f"internal error: {exc}", output=b"")
        values["ended_at"] = self.clock()
        await asyncio.shield(self._finish(inv.id, values))

    async def _finish(self, invocation_id: str, values: dict[str, Any]) -> None:
        for attempt in range(5):
            try:
                async with self.write_lock, self.sessionmaker() as session:
                    ok = await InvocationRepository(session).finish(invocation_id, self.node_id, values)
                    await session.commit()
                if not ok:
                    log.warning("invocation %s was no longer held by this node; its result was dropped", invocation_id)
                return
            except Exception:
                log.exception("recording the end of invocation %s failed (attempt %d)", invocation_id, attempt + 1)
                await asyncio.sleep(0.5 * (attempt + 1))

    # -- leases and retention -------------------------------------------------------------------
    async def _lease_loop(self) -> None:
        """Every second while something runs: renew its leases and pick up cancels asked through
        other nodes. Every third of a lease: end the claims of dead nodes."""
        tick = min(1.0, self.settings.queue_lease_s / 3)
        last_check = 0.0
        while True:
            await asyncio.sleep(tick)
            check = time.monotonic() - last_check >= self.settings.queue_lease_s / 3
            if not self.running and not check:
                continue
            try:
                now = self.clock()
                async with self.write_lock, self.sessionmaker() as session:
                    repo = InvocationRepository(session)
                    cancel = await repo.renew(self.node_id, list(self.running), now + timedelta(seconds=self.settings.queue_lease_s))
                    expired = await repo.interrupt(now) if check else 0
                    if check:
                        self.backlog = await repo.queued_total()
                        self._publish()
                    await session.commit()
                if check:
                    last_check = time.monotonic()
                if expired:
                    log.warning("%d async invocations lost their node (lease expired): ended interrupted", expired)
                for invocation_id in cancel:
                    self.stop_local(invocation_id)
            except OperationalError as exc:  # e.g. SQLite busy under a burst of writes: next round
                log.warning("renewing queue leases failed (%s); will retry", exc.orig)
            except Exception:
                log.exception("renewing queue leases failed; will retry")

    async def _sweep_loop(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception:
                log.exception("sweeping expired outputs failed; will retry")
            await asyncio.sleep(self.settings.queue_sweep_s)

    async def sweep(self) -> int:
        """Delete the outputs older than the retention (their records stay)."""
        async with self.write_lock, self.sessionmaker() as session:
            n = await InvocationRepository(session).expire_outputs(self.clock() - timedelta(seconds=self.settings.output_retention_s))
            await session.commit()
        return n
