"""A front's side of the node: the scheduler's interface over the supervisor's socket, the
node's shared admission table, and the front's own connections to workers (a call's bytes never
pass through the supervisor).

A call of a tenant with bound workers (routes, pushed by the supervisor) is admitted in the table
and sent straight to one of them (app/node/routes.py): the supervisor is not asked. A call of a
tenant with none asks for a lease, and the supervisor binds a worker for it: one lease per call,
released with its outcome as it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from app.contract.errors import NoCapacity, Rejected, RejectReason, SupervisorGone
from app.contract.frames import Payload, ProtocolError
from app.contract.messages import (
    Changed,
    ChangeKind,
    CompileDone,
    CompileSlot,
    Granted,
    Grow,
    Hello,
    LeaseRequest,
    NodeMessage,
    Outcome,
    Principal,
    RateCheck,
    RateOk,
    Readiness,
    Refusal,
    RefusalKind,
    ReleaseLease,
    Route,
    Routes,
    Run,
    SlotGranted,
    Usage,
    View,
    ViewKind,
    ViewReply,
    WithdrawLease,
    WorkerFailed,
    WorkerInfo,
    WorkerMessage,
)
from app.node.admission import ADMISSION_FILE, AdmissionTable, Verdict
from app.node.front_share import FrontShare
from app.node.ipc import pack, read_message
from app.node.routes import DirectLease, RoutedWorker
from app.node.worker_conn import WorkerConnection
from app.observability.phases import ADMIT, clock, lap
from app.scheduler.leases import outcome_of
from app.worker.handle import WorkerLost

log = logging.getLogger(__name__)

# applies a change from another front; what it returns (a flush) is awaited before answering
ChangeHandler = Callable[[ChangeKind, str, str], Awaitable[None] | None]

_POOL_LIMIT = 256  # idle worker connections kept; those of retired workers age out
# "grow" hints from one front, per tenant: the first after this long, each one after that
# unanswered by a change of the tenant's workers twice as long after, up to the longest. A full
# node answers none, and 16 tenants' hints from 8 fronts at the first pace cost its supervisor
# ~13 us a call.
_GROW_EVERY_S = 0.05
_GROW_LONGEST_S = 1.0
_now = time.monotonic  # the hints' clock (tests turn it by hand)


@dataclass(eq=False)
class RemoteLease:
    """A worker leased by the supervisor; this front talks to it over its unix socket."""

    client: SupervisorClient
    grant: Granted
    conn: WorkerConnection | None = field(default=None)
    wait_s: float = 0.0  # the leased worker is the call's alone

    @property
    def kernels_version(self) -> str:
        return self.grant.kernels_version

    async def exchange(self, run: Run, body: bytes, on_chunk: Callable[[Payload], None] | None = None) -> tuple[WorkerMessage, Payload]:
        run.lease = self.grant.token
        try:
            self.conn = conn = self.conn or await self.client.worker_conn(self.grant)  # sent again: the same connection
            return await conn.exchange(run, body, on_chunk)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ProtocolError) as exc:
            raise WorkerLost(f"worker {self.grant.worker_id}: {exc}") from exc


class SupervisorClient:
    def __init__(
        self, path: str, queue_limit: int = 256, queue_wait_s: float = 1.0, share_per_pass: int = 1, share_linger_s: float = 0.05,
    ) -> None:
        self.path = path
        self.queue_limit = queue_limit
        self.queue_wait_s = queue_wait_s
        # this front's time between tenants (app/node/front_share.py); 0: no call waits for a turn
        self.share = FrontShare(share_per_pass, share_linger_s) if share_per_pass > 0 else None
        self.front = 0
        self.table: AdmissionTable | None = None
        self._routes: dict[str, list[RoutedWorker]] = {}
        # their admission-table slots, in the same order: the admission step takes them on
        # every call (built there per call with the worker then found again, ~1.1 us on the dev VM)
        self._route_slots: dict[str, list[int]] = {}
        self._grown: dict[str, tuple[float, float]] = {}  # tenant id -> (next hint's earliest time, the pace after it)
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[NodeMessage]] = {}
        self._ids = itertools.count(1)
        self._pool: dict[str, list[WorkerConnection]] = {}
        self._pooled = 0  # connections in the pool
        self._on_change: ChangeHandler | None = None
        self._tasks: set[asyncio.Future[None]] = set()

    # -- connection -----------------------------------------------------------------------------
    async def connect(self, on_change: ChangeHandler | None = None, front: int = 0) -> None:
        self._on_change = on_change
        self.front = front
        table = Path(self.path).parent / ADMISSION_FILE
        if table.exists():
            self.table = AdmissionTable.attach(table)
            self.table.reclaim(front)  # what a front of this index that died still counted
        reader, self._writer = await asyncio.open_unix_connection(self.path, limit=1 << 20)
        self._writer.write(pack(Hello(front=front, pid=os.getpid())))
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop(reader))

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
        if self._writer is not None:
            self._writer.close()
        for conns in self._pool.values():
            for c in conns:
                c.close()
        self._pool.clear()
        self._pooled = 0
        self._routes.clear()
        self._route_slots.clear()
        if self.table is not None:
            self.table.close()
            self.table = None

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                msg = await read_message(reader)
                if isinstance(msg, Routes):
                    self._set_routes(msg)
                    continue
                if isinstance(msg, Changed):
                    self._apply(msg)
                    continue
                req = getattr(msg, "req", None)
                fut = self._pending.pop(req, None) if req is not None else None
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                else:
                    self._hand_back(msg)
        except (asyncio.IncompleteReadError, ConnectionError, ProtocolError) as exc:
            log.error("lost the supervisor's connection: %s", exc)
        finally:
            self._writer = None
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(SupervisorGone("this node's supervisor is gone"))
            self._pending.clear()

    def _apply(self, msg: Changed) -> None:
        """Apply a change from another front; answer its token once done (a flush: once written)."""
        pending = self._on_change(msg.kind, msg.tenant_id, msg.name) if self._on_change is not None else None
        if not msg.token:
            return
        if pending is None:
            self._applied(msg.token)
            return
        task = asyncio.ensure_future(pending)
        self._tasks.add(task)

        def done(t: asyncio.Future[None]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("applying %s failed: %s", msg.kind.value, t.exception())
            self._applied(msg.token)  # answered anyway: the origin must not wait on a failure

        task.add_done_callback(done)

    def _applied(self, token: str) -> None:
        with contextlib.suppress(SupervisorGone):
            self._send(Changed(ChangeKind.APPLIED, token=token))

    def _send(self, msg: NodeMessage) -> None:
        if self._writer is None:
            raise SupervisorGone("this node's supervisor is gone")
        self._writer.write(pack(msg))  # small messages: the socket buffer takes them at once

    async def _ask(self, build: Callable[[int], NodeMessage]) -> NodeMessage:
        req = next(self._ids)
        fut: asyncio.Future[NodeMessage] = asyncio.get_running_loop().create_future()
        self._pending[req] = fut
        msg = build(req)
        try:
            self._send(msg)
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._hand_back(fut.result())  # granted as its caller went away
            elif isinstance(msg, LeaseRequest):
                with contextlib.suppress(SupervisorGone):  # out of the queue: no worker bound for it
                    self._send(WithdrawLease(req))
            raise
        finally:
            self._pending.pop(req, None)

    def _hand_back(self, msg: NodeMessage) -> None:
        """A lease or compile slot granted to a caller that went away while it waited: back
        unused, so the supervisor does not hold it to a deadline."""
        if isinstance(msg, Granted):
            self._send(ReleaseLease(msg.lease_id, Outcome.UNUSED, msg.kernels_version))
        elif isinstance(msg, SlotGranted):
            self._send(CompileDone(msg.tenant_id))

    @staticmethod
    def _refused(msg: NodeMessage) -> Exception:
        if isinstance(msg, Refusal):
            if msg.kind == RefusalKind.REJECTED:
                return Rejected(msg.reason, msg.message, msg.retry_after)
            return NoCapacity(msg.message)
        return SupervisorGone(f"the supervisor answered {type(msg).__name__}")

    # -- routes ---------------------------------------------------------------------------------
    def _put_routes(self, tenant_id: str, workers: list[RoutedWorker]) -> None:
        """The tenant's routed workers now (none: its calls ask for a lease), with their slots."""
        if workers:
            self._routes[tenant_id] = workers
            self._route_slots[tenant_id] = [w.route.slot for w in workers]
        else:
            self._routes.pop(tenant_id, None)
            self._route_slots.pop(tenant_id, None)

    def _set_routes(self, msg: Routes) -> None:
        self._grown.pop(msg.tenant_id, None)  # its workers changed: hints go at the first pace again
        old = {w.route.worker_id: w for w in self._routes.get(msg.tenant_id, [])}
        kept = [old.pop(r.worker_id) if r.worker_id in old else RoutedWorker.of(r) for r in msg.workers]
        for w in old.values():  # retired: calls on their way to it are sent again if not started
            w.gone = True  # its page stays open while a call holds it (it says whether the call started)
        self._put_routes(msg.tenant_id, kept)

    def forget_worker(self, tenant_id: str, worker: RoutedWorker) -> None:
        workers = self._routes.get(tenant_id)
        if workers is not None and worker in workers:
            self._put_routes(tenant_id, [w for w in workers if w is not worker])
        worker.gone = True

    def worker_failed(self, worker: RoutedWorker, outcome: Outcome) -> None:
        """The supervisor replaces it; this front stops sending to it now."""
        for tenant_id, workers in list(self._routes.items()):
            if worker in workers:
                self.forget_worker(tenant_id, worker)
        with contextlib.suppress(SupervisorGone):
            self._send(WorkerFailed(worker.route.worker_id, outcome))

    def reroute(self, lease: DirectLease, tried: set[str]) -> RoutedWorker | None:
        """Move a call not yet started to another routed worker of its tenant (None: none left)."""
        assert self.table is not None
        workers = [w for w in self._routes.get(lease.principal.id, []) if w.route.worker_id not in tried and not w.gone]
        nxt = min(workers, key=lambda w: self.table.queued(w.route.slot)) if workers else None  # type: ignore[union-attr]
        self.table.move(self.front, lease.queue_slot, nxt.route.slot if nxt is not None else -1)
        if nxt is not None:
            lease.worker, lease.queue_slot = nxt, nxt.route.slot
        return nxt

    async def remote_lease(self, principal: Principal, hard_timeout_s: float, traceparent: str | None) -> RemoteLease:
        msg = await self._ask(lambda req: LeaseRequest(req, principal, hard_timeout_s, False, traceparent))
        if not isinstance(msg, Granted):
            raise self._refused(msg)
        return RemoteLease(self, msg)

    def _admit(self, principal: Principal, worker_slots: list[int] | None) -> tuple[int, int, int]:
        """One step in the table: (tenant entry, worker slot or -1, its queue before this call)."""
        assert self.table is not None
        q = principal.quota
        a = self.table.admit(self.front, principal.id, q.requests_per_second, q.max_concurrency + self.queue_limit, worker_slots)
        if a.verdict == Verdict.RATE:
            raise Rejected(
                RejectReason.RATE, f"tenant exceeded its rate of {q.requests_per_second:g} invocations per second",
                max(1, int(a.retry_after + 0.999)),
            )
        if a.verdict == Verdict.FULL:
            raise Rejected(
                RejectReason.QUEUE_FULL, f"tenant is at its concurrency limit ({q.max_concurrency}) and its queue is full", 1
            )
        if a.verdict == Verdict.TABLE_FULL:
            raise NoCapacity("this node's admission table is full (too many tenants with calls in flight)")
        return a.slot, a.worker, a.depth

    def _grow(self, principal: Principal) -> None:
        now = _now()
        next_at, every = self._grown.get(principal.id, (0.0, _GROW_EVERY_S))
        if now < next_at:
            return
        if len(self._grown) > 10_000:
            self._grown.clear()
        self._grown[principal.id] = (now + every, min(2 * every, _GROW_LONGEST_S))
        with contextlib.suppress(SupervisorGone):
            self._send(Grow(principal))

    # -- NodePort -------------------------------------------------------------------------------
    async def lease(self, principal: Principal, hard_timeout_s: float, traceparent: str | None, check_rate: bool) -> RemoteLease | DirectLease:
        if self.table is None:  # no shared table (a supervisor of an older layout): every call asks
            msg = await self._ask(lambda req: LeaseRequest(req, principal, hard_timeout_s, check_rate, traceparent))
            if not isinstance(msg, Granted):
                raise self._refused(msg)
            return RemoteLease(self, msg)
        t = clock()
        workers = self._routes.get(principal.id)
        slots = self._route_slots.get(principal.id)
        slot, queue_slot, depth = self._admit(principal, slots)
        if workers and slots:
            picked = workers[slots.index(queue_slot)]
            if depth > 0 and len(workers) < principal.quota.max_concurrency:
                self._grow(principal)  # its calls queue at every worker: one more, if its share allows
            direct = DirectLease(self, principal, slot, picked, queue_slot, hard_timeout_s, traceparent, self.queue_wait_s)
            direct.routed = len(workers)
            if self.share is not None:
                direct.depth, direct.shared = depth, True
                self.share.admitted(principal.id, depth > 0)
            lap(ADMIT, t)
            return direct
        lease = DirectLease(self, principal, slot, None, -1, hard_timeout_s, traceparent, 0.0)
        lap(ADMIT, t)  # not the supervisor's lease: that is a wait
        try:
            lease.remote = await self.remote_lease(principal, hard_timeout_s, traceparent)
        except BaseException:
            self.table.leave(self.front, slot)
            raise
        return lease

    def release(self, lease: object, outcome: Outcome, kernels_version: str) -> None:
        if isinstance(lease, DirectLease):
            self._release_direct(lease, outcome, kernels_version)
            return
        assert isinstance(lease, RemoteLease)
        conn, lease.conn = lease.conn, None
        if conn is not None:
            if outcome == Outcome.OK:
                self._park(lease.grant.worker_id, conn)
            else:  # the worker is being replaced, or its reply is still on the way
                conn.close()
        with contextlib.suppress(SupervisorGone):
            self._send(ReleaseLease(lease.grant.lease_id, outcome, kernels_version))

    def _release_direct(self, lease: DirectLease, outcome: Outcome, kernels_version: str) -> None:
        if lease.remote is not None:
            self.release(lease.remote, outcome, kernels_version)
        elif lease.worker is not None:
            worker, conn = lease.worker, lease.conn
            lease.conn = None
            if outcome == Outcome.HARD_TIMEOUT and lease.invocation_id and not worker.started(lease.invocation_id):
                outcome = Outcome.UNUSED  # still queued behind another call: that call's deadline kills it
                if conn is not None:
                    conn.close()  # the worker reads the run at EOF and stops it at once
                    conn = None
            if conn is not None:
                if outcome == Outcome.OK:
                    self._park(worker.route.worker_id, conn)
                else:
                    conn.close()
            if outcome in (Outcome.OK, Outcome.UNUSED):
                worker.kernels_version = kernels_version or worker.kernels_version
            else:
                self.worker_failed(worker, outcome)
        if self.table is not None:
            self.table.leave(self.front, lease.slot, lease.queue_slot)
            lease.queue_slot = -1
        if lease.shared and self.share is not None:
            lease.shared = False
            self.share.leave(lease.principal.id, lease.depth > 0)

    def routed(self, tenant_id: str) -> bool:
        return bool(self._routes.get(tenant_id))

    def turn_ahead(self, tenant_id: str) -> asyncio.Future[None] | None:
        return None if self.share is None else self.share.turn_ahead(tenant_id)

    def turn(self, lease: object) -> asyncio.Future[None] | None:
        if self.share is None or not isinstance(lease, DirectLease) or not lease.depth:
            return None
        return self.share.turn(lease.principal.id)

    def stop(self, lease: object, within_s: float, kernels_version: str) -> None:
        assert isinstance(lease, (RemoteLease, DirectLease))
        holder = lease.remote if isinstance(lease, DirectLease) and lease.remote is not None else lease
        conn, holder.conn = holder.conn, None
        if conn is None:  # the run never left: nothing to stop
            self.release(lease, Outcome.UNUSED, kernels_version)
            return
        task = asyncio.get_running_loop().create_task(self._stop(lease, conn, within_s, kernels_version))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stop(self, lease: object, conn: WorkerConnection, within_s: float, kernels_version: str) -> None:
        """Half-close the run's connection (the worker stops the guest when it turns readable)
        and read to the worker's answer; the lease, and so the tenant's slot, is held till then."""
        outcome = Outcome.HARD_TIMEOUT
        try:
            async with asyncio.timeout(within_s):
                conn.write_eof()
                msg, _ = await conn.next_frame()  # a streamed run's chunks are nobody's now: dropped
            outcome = outcome_of(msg)
        except TimeoutError:
            pass  # stuck outside the guest's code (a host call): replaced, as at its deadline
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ProtocolError):
            outcome = Outcome.LOST
        finally:
            conn.close()  # half-closed: never pooled
            self.release(lease, outcome, kernels_version)

    async def check_rate(self, principal: Principal) -> None:
        if self.table is not None:
            wait = self.table.take_rate(principal.id, principal.quota.requests_per_second)
            if wait > 0:
                q = principal.quota
                raise Rejected(
                    RejectReason.RATE, f"tenant exceeded its rate of {q.requests_per_second:g} invocations per second", max(1, int(wait + 0.999))
                )
            return
        msg = await self._ask(lambda req: RateCheck(req, principal))
        if not isinstance(msg, RateOk):
            raise self._refused(msg)

    async def _view(self, kind: ViewKind, tenant_id: str = "") -> ViewReply:
        msg = await self._ask(lambda req: View(req, kind, tenant_id))
        if not isinstance(msg, ViewReply):
            raise self._refused(msg)
        return msg

    async def usage(self, tenant_id: str) -> Usage:
        reply = await self._view(ViewKind.USAGE, tenant_id)
        assert reply.usage is not None
        return reply.usage

    async def workers(self) -> list[WorkerInfo]:
        return (await self._view(ViewKind.WORKERS)).workers or []

    async def readiness(self) -> Readiness:
        try:
            reply = (await self._view(ViewKind.READY)).readiness
        except SupervisorGone:
            reply = None
        return reply or Readiness(workers=False, devices_usable=False, devices=[])

    async def flush_records(self) -> None:
        await self.publish(ChangeKind.FLUSH, "")

    async def metrics_text(self) -> bytes:
        return (await self._view(ViewKind.METRICS)).metrics

    def announce(self, kind: ChangeKind, tenant_id: str, name: str = "") -> None:
        with contextlib.suppress(SupervisorGone):
            self._send(Changed(kind, tenant_id, name))

    async def publish(self, kind: ChangeKind, tenant_id: str, name: str = "") -> None:
        with contextlib.suppress(SupervisorGone):
            await self._ask(lambda req: Changed(kind, tenant_id, name, req=req))

    # -- the node's compile limiter ---------------------------------------------------------------
    @asynccontextmanager
    async def slot(self, tenant_id: str) -> AsyncIterator[None]:
        """A compile slot from the supervisor's fair limiter, held while the compile runs."""
        msg = await self._ask(lambda req: CompileSlot(req, tenant_id))
        if not isinstance(msg, SlotGranted):
            raise self._refused(msg)
        try:
            yield
        finally:
            with contextlib.suppress(SupervisorGone):
                self._send(CompileDone(tenant_id))

    # -- worker connections ---------------------------------------------------------------------
    async def worker_conn(self, grant: Granted) -> WorkerConnection:
        return await self._conn(grant.worker_id, grant.socket)

    async def route_conn(self, route: Route) -> WorkerConnection:
        return await self._conn(route.worker_id, route.socket)

    async def _conn(self, worker_id: str, socket: str) -> WorkerConnection:
        conns = self._pool.get(worker_id)
        while conns:
            conn = conns.pop()
            self._pooled -= 1
            if not conn.at_eof():
                return conn
            conn.close()
        return await WorkerConnection.open(socket)

    def _park(self, worker_id: str, conn: WorkerConnection) -> None:
        while self._pooled >= _POOL_LIMIT and self._pool:  # oldest worker first: retired ones age out
            oldest = self._pool.pop(next(iter(self._pool)))
            self._pooled -= len(oldest)
            for c in oldest:
                c.close()
        self._pool.setdefault(worker_id, []).append(conn)
        self._pooled += 1
