"""The queue runner: claims queued async invocations from the database and runs them.

One per node. It claims the oldest queued work (FIFO per tenant) while it has room, never more
of one tenant than that tenant's `max_concurrency`, and runs each through the same scheduler
path as a synchronous call, so quotas and fairness are the same. A claim carries this node's id,
the attempt it starts and a lease it renews while the call runs. The node heartbeats in the
database (app/queue/nodes.py); the work of a node that stopped heartbeating (or whose lease ran
out) is queued again by whichever node notices first, up to the function's `max_attempts`, and
ends `interrupted` once they are spent: at-least-once. At its start a node does the same with its
own claims of a previous life, and at a clean stop with what it was running. It depends on an
executor and repositories only, so it can move into a supervisor process unchanged.
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
from app.contract.messages import Principal
from app.db.models import Invocation
from app.db.repositories.invocations import InvocationRepository, Recovered
from app.db.repositories.nodes import NodeRepository
from app.db.repositories.tenants import TenantRepository
from app.errors import NotFound
from app.queue.nodes import NodeHeartbeat
from app.queue.states import InvocationStatus
from app.services.principal import principal_of
from app.settings import Settings

log = logging.getLogger(__name__)

# A database busy at a node's start (its fronts all starting, SQLite's lock held past its wait)
# fails the runner's first writes: tried this often, a second apart, before the front gives up
# its start (and is started again).
START_TRIES = 5
START_RETRY_S = 1.0


class Execution(Protocol):
    status: InvocationStatus
    version: int
    content_type: str
    duration_ms: float
    exit_code: int | None
    error: str | None
    stdout: bytes | memoryview  # stored as it is: a large output is not copied first
    stderr_tail: str | None


class Execute(Protocol):
    def __call__(
        self, tenant: Principal, name: str, invocation_id: str, body: bytes, query: str, content_type: str, *,
        args: list[str] | None = None, version: int | None = None,
    ) -> Awaitable[Execution]: ...


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
        self._attempt: dict[str, int] = {}  # the attempt each running invocation is, for its finish
        self._tenant_of: dict[str, str] = {}
        self._principals: dict[str, tuple[float, Principal | None]] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.started_count = 0
        self.backlog = 0  # queued async invocations in the database (every node's), as last counted
        self.on_counts: Callable[[int, int], object] | None = None  # (backlog, running) as they change
        self.start_delays: list[float] = []  # submit-to-start seconds, for the benchmark
        self.heartbeat = NodeHeartbeat(sessionmaker, settings, clock, self.write_lock)
        self.recovered = Recovered()  # lost nodes' work this node queued again or ended, since its start
        self.on_recovered: Callable[[Recovered], object] | None = None  # each time some was
        self.nodes_alive = 0  # nodes with a recent heartbeat, this one included, as last counted
        self.on_nodes: Callable[[int], object] | None = None  # that count, at each heartbeat
        # an invocation's end, in the transaction that records it (its log lines), and once
        # committed (its callback is due)
        self.on_finish: Callable[[AsyncSession, str, dict[str, Any]], Awaitable[None]] | None = None
        self.on_ended: Callable[[str], object] | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        for attempt in range(1, START_TRIES + 1):
            try:
                await self.heartbeat.beat(started=True)
                async with self.write_lock, self.sessionmaker() as session:
                    done = await InvocationRepository(session).recover(self.clock(), node_id=self.node_id)
                    await session.commit()
                break
            except OperationalError as exc:
                if attempt == START_TRIES:
                    raise
                log.warning("the queue's first writes failed (%s); trying again", exc.orig)
                await asyncio.sleep(START_RETRY_S)
        self._note_recovered(done, "were running when this node last stopped")
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._claim_loop()), loop.create_task(self._lease_loop()), loop.create_task(self._sweep_loop()),
            loop.create_task(self._node_loop()),
        ]

    async def stop(self) -> None:
        """Stop claiming; what is running is cancelled and queued again for another node (an
        attempt spent), or ends `interrupted` if it was its last."""
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
            async with self.write_lock, self.sessionmaker() as session:
                done = await InvocationRepository(session).recover(self.clock(), node_id=self.node_id)
                await session.commit()
            self._note_recovered(done, "were running when this node stopped")
        with contextlib.suppress(Exception):
            await self.heartbeat.forget()

    def _note_recovered(self, done: Recovered, what: str) -> None:
        if not done.total:
            return
        log.warning(
            "%d async invocations %s: %d queued again, %d interrupted (attempts spent), %d cancelled",
            done.total, what, done.requeued, done.interrupted, done.cancelled,
        )
        self.recovered.requeued += done.requeued
        self.recovered.interrupted += done.interrupted
        self.recovered.cancelled += done.cancelled
        if self.on_recovered is not None:
            self.on_recovered(done)
        self._wake.set()  # work queued again: claim it

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
            for inv in give_back:  # as it was before the claim, its attempt not counted
                inv.status, inv.claimed_by, inv.started_at, inv.lease_expires_at = InvocationStatus.QUEUED.value, None, None, None
                inv.attempt -= 1
            await session.commit()
        for inv in taken:
            self._launch(inv, now)
        return bool(taken) and not give_back

    async def _principal(self, tenant_id: str) -> Principal | None:
        """The tenant and its quota, cached like the api's auth cache (changes apply within its TTL)."""
        hit = self._principals.get(tenant_id)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        async with self.sessionmaker() as session:
            t = await TenantRepository(session).get(tenant_id)
        p = principal_of(t) if t is not None else None
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
        old = self.running.get(inv.id)
        if old is not None:  # an attempt this node lost (it stalled) and claimed again: stop the old one
            old.cancel()
        task = asyncio.get_running_loop().create_task(self._run(inv))
        self.running[inv.id] = task
        self._tenant_of[inv.id] = inv.tenant_id
        self._attempt[inv.id] = inv.attempt

        self._publish()

        def done(t: asyncio.Task[None], key: str = inv.id) -> None:
            if self.running.get(key) is not t:
                return  # a newer attempt of the same invocation runs under this key
            self.running.pop(key, None)
            self._tenant_of.pop(key, None)
            self._attempt.pop(key, None)
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
                    ex = await self.execute(
                        principal, inv.function, inv.id, inv.input or b"", inv.query_string or "", inv.request_content_type or "",
                        args=inv.args, version=inv.pinned_version,
                    )
                    break
                except (Rejected, NoCapacity) as exc:  # the tenant is busy on this node: wait, keep the claim
                    await asyncio.sleep(getattr(exc, "retry_after", 1) * 0.25)
            values = dict(
                status=ex.status.value, version=ex.version, duration_ms=ex.duration_ms, exit_code=ex.exit_code,
                error=ex.error, stderr_tail=ex.stderr_tail, output=ex.stdout, content_type=ex.content_type,
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
        await asyncio.shield(self._finish(inv.id, inv.attempt, values))

    async def _finish(self, invocation_id: str, attempt: int, values: dict[str, Any]) -> None:
        for tries in range(5):
            try:
                async with self.write_lock, self.sessionmaker() as session:
                    if values.get("output"):
                        values = await self._within_storage(session, invocation_id, values)
                    ok = await InvocationRepository(session).finish(invocation_id, self.node_id, attempt, values)
                    if ok and self.on_finish is not None:
                        await self.on_finish(session, invocation_id, values)
                    await session.commit()
                if ok and self.on_ended is not None:
                    self.on_ended(invocation_id)
                if not ok:
                    log.warning(
                        "invocation %s (attempt %d) was no longer held by this node (taken for lost and queued again); "
                        "its result was dropped", invocation_id, attempt,
                    )
                return
            except Exception:
                log.exception("recording the end of invocation %s failed (try %d)", invocation_id, tries + 1)
                await asyncio.sleep(0.5 * (tries + 1))

    async def _within_storage(self, session: AsyncSession, invocation_id: str, values: dict[str, Any]) -> dict[str, Any]:
        """An output is stored while its tenant's stored bytes are under max_stored_bytes (the one
        that crosses it is kept whole: at most one output's size over). Past it the output is
        dropped and the invocation ends `output_limit`, saying why. Under the tenant's lock, so
        outputs ending at once on any node are counted one after another."""
        tenant_id = await InvocationRepository(session).tenant_of(invocation_id)
        if tenant_id is None:
            return values
        tenants = TenantRepository(session)
        row = await tenants.lock(tenant_id)
        if row is None:
            return values
        stored = await tenants.stored_bytes(tenant_id, except_input_of=invocation_id)
        if stored.total < row.max_stored_bytes:
            return values
        size = len(values["output"])
        was = f"{values['status']}: {values['error']}" if values.get("error") else values["status"]
        return {
            **values, "status": InvocationStatus.OUTPUT_LIMIT.value, "output": b"",
            "error": f"the output ({size} bytes) was not stored: the tenant's stored bytes ({stored.total}) are at its "
            f"max_stored_bytes quota of {row.max_stored_bytes}; fetch and let outputs expire, or delete functions "
            f"(the guest's own outcome: {was})",
        }

    # -- leases and retention -------------------------------------------------------------------
    async def _lease_loop(self) -> None:
        """Every second while something runs: renew its leases, pick up cancels asked through
        other nodes, and stop what this node no longer holds. Every third of a lease: count the
        backlog."""
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
                    cancel, lost = await repo.renew(
                        self.node_id, list(self.running), now + timedelta(seconds=self.settings.queue_lease_s)
                    )
                    if check:
                        self.backlog = await repo.queued_total()
                        self._publish()
                    await session.commit()
                if check:
                    last_check = time.monotonic()
                for invocation_id in lost:
                    log.warning("async invocation %s was taken from this node (it was late to heartbeat): stopped here", invocation_id)
                for invocation_id in [*cancel, *lost]:
                    self.stop_local(invocation_id)
            except OperationalError as exc:  # e.g. SQLite busy under a burst of writes: next round
                log.warning("renewing queue leases failed (%s); will retry", exc.orig)
            except Exception:
                log.exception("renewing queue leases failed; will retry")

    async def _node_loop(self) -> None:
        """Every heartbeat: say this node is alive, and recover the work of nodes that are not
        (not seen for TENSORWASM_NODE_DEAD_AFTER_S) or whose lease ran out."""
        while True:
            await asyncio.sleep(self.settings.node_heartbeat_s)
            try:
                await self.heartbeat.beat()
                now = self.clock()
                async with self.write_lock, self.sessionmaker() as session:
                    dead_before = now - timedelta(seconds=self.settings.node_dead_after_s)
                    done = await InvocationRepository(session).recover(now, dead_seen_before=dead_before, alive=self.node_id)
                    alive = await NodeRepository(session).live_count(dead_before)
                    await session.commit()
                self._note_recovered(done, "lost their node")
                self.nodes_alive = alive
                if self.on_nodes is not None:
                    self.on_nodes(alive)
            except OperationalError as exc:  # e.g. the database out of reach for a moment: next beat
                log.warning("the node heartbeat failed (%s); will retry", exc.orig)
            except Exception:
                log.exception("the node heartbeat failed; will retry")

    async def _sweep_loop(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception:
                log.exception("sweeping expired outputs failed; will retry")
            await asyncio.sleep(self.settings.queue_sweep_s)

    async def sweep(self) -> int:
        """Delete the outputs and stderr tails older than the output retention (their records
        stay), and the records older than the record retention; returns the outputs deleted."""
        now = self.clock()
        async with self.write_lock, self.sessionmaker() as session:
            repo = InvocationRepository(session)
            n = await repo.expire_outputs(now - timedelta(seconds=self.settings.output_retention_s))
            await repo.delete_ended_before(now - timedelta(seconds=self.settings.record_retention_s))
            await self.heartbeat.prune(session)
            await session.commit()
        return n
