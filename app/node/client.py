"""A front's side of the node: the scheduler's interface over the supervisor's socket, and the
front's own connections to leased workers (a call's bytes never pass through the supervisor).

Held leases (app/node/supervisor.py): a lease granted with `hold_s` is parked here after a clean
call instead of being released, and the tenant's next call on this front takes it without asking
the supervisor, while it has paid runs left, its hold lasts and the call's hard timeout is within
the one the supervisor's deadline covers. A parked lease goes back after `idle_s` without a call,
at the end of its hold, and at once when the supervisor recalls it.

Handoffs (`Granted.handoffs`): as a call on such a lease ends cleanly, the lease goes to this
front's oldest call of the tenant still waiting for its own lease that the supervisor admitted
(`Queued`: rate, queue limit), if any and if no more than `_HANDOFF_WAITING_MAX` wait, with a
`Handoff` to the supervisor, which takes that call's request out of its queue. A grant that
crosses a handoff to its call serves the next waiting call the same way, or goes back unused.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from app.contract.errors import NoCapacity, Rejected, SupervisorGone
from app.contract.frames import ProtocolError, encode, read_frame_async
from app.contract.messages import (
    Changed,
    ChangeKind,
    Chunk,
    CompileDone,
    CompileSlot,
    Granted,
    Handoff,
    Hello,
    LeaseRequest,
    NodeMessage,
    Outcome,
    Principal,
    Queued,
    Quota,
    RateCheck,
    RateOk,
    Readiness,
    Recall,
    Refusal,
    RefusalKind,
    ReleaseLease,
    Run,
    SlotGranted,
    Usage,
    View,
    ViewKind,
    ViewReply,
    WorkerInfo,
    WorkerMessage,
)
from app.node.ipc import pack, read_message
from app.observability.tracing import Tracing
from app.scheduler.leases import outcome_of
from app.services.principal import TenantPrincipal
from app.worker.client import WorkerLost

log = logging.getLogger(__name__)

# applies a change from another front; what it returns (a flush) is awaited before answering
ChangeHandler = Callable[[ChangeKind, str, str], Awaitable[None] | None]

# A front passes a lease on only while at most this many calls of the tenant wait in it. A front
# with more waiting is busy: its loop would put all of its calls' work between each run and the
# next on the worker, where grants spread a worker's calls over every front's loop. H200 host,
# 8 fronts, req/s against lease per call (two rounds): c=32 +22%/+24%, c=64 +3%/-2%, c=256
# +8%/+7%; passing on with no such bound: c=32 +15%, c=256 -39% (worker idle 1.25 ms between
# runs against 0.62 ms).
_HANDOFF_WAITING_MAX = 4
_POOL_LIMIT = 256  # idle worker connections kept; those of retired workers age out


def principal_of(p: TenantPrincipal) -> Principal:
    q = p.quota
    return Principal(
        p.id,
        p.name,
        Quota(**q.as_dict()),  # type: ignore[arg-type]
    )


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


@dataclass(eq=False)
class RemoteLease:
    """A worker leased by the supervisor; this front talks to it over its unix socket."""

    client: SupervisorClient
    grant: Granted
    conn: _Conn | None = field(default=None)
    hard_timeout_s: float = 0.0  # the longest call the supervisor's deadline covers
    kernels: str = ""  # what its worker holds now
    hold_until: float = 0.0  # (event-loop time) no call starts on it later; 0: one call only
    runs: int = 1  # calls it carried
    runs_left: int = 0  # calls it may still carry, paid for at the grant
    handoffs_left: int = 0  # calls waiting in this front it may still be passed to
    handed: bool = False  # its current call came by a handoff (else: the grant, or a paid run)
    recalled: bool = False
    idle: asyncio.TimerHandle | None = None  # set while parked

    @property
    def kernels_version(self) -> str:
        return self.kernels

    async def exchange(self, run: Run, body: bytes, on_chunk: Callable[[bytes], None] | None = None) -> tuple[WorkerMessage, bytes]:
        run.lease = self.grant.token
        try:
            self.conn = conn = await self.client.worker_conn(self.grant)
            conn.writer.writelines(encode(run, body))
            await conn.writer.drain()
            while True:
                msg, out = await read_frame_async(conn.reader)
                if not isinstance(msg, Chunk):
                    return msg, out
                if on_chunk is not None:
                    on_chunk(out)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ProtocolError) as exc:
            raise WorkerLost(f"worker {self.grant.worker_id}: {exc}") from exc


class SupervisorClient:
    def __init__(self, path: str, idle_s: float = 0.005, tracing: Tracing | None = None) -> None:
        self.path = path
        self.idle_s = idle_s
        self.tracing = tracing
        self._holding: dict[str, RemoteLease] = {}  # held leases by id, parked or in a call
        self._parked: dict[str, list[RemoteLease]] = {}  # by tenant id, the last parked on top
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[NodeMessage]] = {}
        self._ids = itertools.count(1)
        self._pool: dict[str, list[_Conn]] = {}
        self._pooled = 0  # connections in the pool
        self._on_change: ChangeHandler | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        self._principals: dict[int, tuple[TenantPrincipal, Principal]] = {}
        # lease requests asked and not answered, by tenant id, oldest first: what a handoff serves
        self._asked: dict[str, dict[int, tuple[asyncio.Future[NodeMessage | RemoteLease], float]]] = {}
        self._queued: set[int] = set()  # those of them the supervisor admitted (`Queued`)

    # -- connection -----------------------------------------------------------------------------
    async def connect(self, on_change: ChangeHandler | None = None, front: int = 0) -> None:
        self._on_change = on_change
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
        for lease in self._holding.values():
            if lease.idle is not None:
                lease.idle.cancel()
        self._holding.clear()
        self._parked.clear()
        for conns in self._pool.values():
            for c in conns:
                c.close()
        self._pool.clear()
        self._pooled = 0

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                msg = await read_message(reader)
                if isinstance(msg, Changed):
                    self._apply(msg)
                    continue
                if isinstance(msg, Recall):
                    self._recalled(msg.lease_ids)
                    continue
                if isinstance(msg, Queued):
                    if msg.req in self._pending:
                        self._queued.add(msg.req)
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
        try:
            self._send(build(req))
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._hand_back(fut.result())  # granted as its caller went away
            raise
        finally:
            self._pending.pop(req, None)

    def _hand_back(self, msg: NodeMessage | RemoteLease) -> None:
        """A lease or compile slot granted to a caller that went away while it waited, or a grant
        that crossed a handoff to its call: a lease goes to the next call of its tenant waiting
        here, else back unused, so the supervisor does not hold it to a deadline."""
        if isinstance(msg, RemoteLease):
            self.release(msg, Outcome.UNUSED, msg.kernels)
        elif isinstance(msg, Granted):
            if not self._pass_grant(msg):
                self._send(ReleaseLease(msg.lease_id, Outcome.UNUSED, msg.kernels_version))
        elif isinstance(msg, SlotGranted):
            self._send(CompileDone(msg.tenant_id))

    def _principal(self, p: TenantPrincipal) -> Principal:
        hit = self._principals.get(id(p))
        if hit is not None and hit[0] is p:
            return hit[1]
        if len(self._principals) > 10_000:
            self._principals.clear()
        msg = principal_of(p)
        self._principals[id(p)] = (p, msg)
        return msg

    @staticmethod
    def _refused(msg: NodeMessage) -> Exception:
        if isinstance(msg, Refusal):
            if msg.kind == RefusalKind.REJECTED:
                return Rejected(msg.reason, msg.message, msg.retry_after)
            return NoCapacity(msg.message)
        return SupervisorGone(f"the supervisor answered {type(msg).__name__}")

    # -- NodePort -------------------------------------------------------------------------------
    async def lease(self, principal: TenantPrincipal, hard_timeout_s: float, traceparent: str | None, check_rate: bool) -> RemoteLease:
        if check_rate:  # a held lease's calls were paid for against the rate when it was granted
            held = self._take_parked(principal.id, hard_timeout_s)
            if held is not None:
                if self.tracing is not None and self.tracing.enabled:  # the lease span, from here this time
                    with self.tracing.span("scheduler.lease", {"tensorwasm.tenant": principal.name, "tensorwasm.lease.held": True}):
                        pass
                return held
        msg = await self._ask_lease(principal, hard_timeout_s, traceparent, check_rate)
        if isinstance(msg, RemoteLease):  # passed on by the tenant's previous call here
            if self.tracing is not None and self.tracing.enabled:
                with self.tracing.span("scheduler.lease", {"tensorwasm.tenant": principal.name, "tensorwasm.lease.handoff": True}):
                    pass
            return msg
        if not isinstance(msg, Granted):
            raise self._refused(msg)
        return self._remote(msg, hard_timeout_s)

    def _remote(self, grant: Granted, hard_timeout_s: float) -> RemoteLease:
        lease = RemoteLease(
            self, grant, hard_timeout_s=hard_timeout_s, kernels=grant.kernels_version,
            runs_left=grant.token.runs - 1 - grant.handoffs, handoffs_left=grant.handoffs,
        )
        if grant.hold_s > 0:
            lease.hold_until = asyncio.get_running_loop().time() + grant.hold_s
        if grant.hold_s > 0 or grant.handoffs > 0:
            self._holding[grant.lease_id] = lease
        return lease

    async def _ask_lease(self, principal: TenantPrincipal, hard_timeout_s: float, traceparent: str | None, check_rate: bool) -> NodeMessage | RemoteLease:
        """`_ask` for a lease, the request queued here too while it waits: the supervisor's
        answer, or a lease a call of the tenant ending here passed on (`_hand_off`)."""
        p = self._principal(principal)
        req = next(self._ids)
        fut: asyncio.Future[NodeMessage | RemoteLease] = asyncio.get_running_loop().create_future()
        self._pending[req] = fut  # type: ignore[assignment]  # the reader sets node messages only
        asked = self._asked.get(principal.id)
        if asked is None:
            asked = self._asked[principal.id] = {}
        asked[req] = (fut, hard_timeout_s)
        try:
            self._send(LeaseRequest(req, p, hard_timeout_s, check_rate, traceparent))
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._hand_back(fut.result())  # granted or passed on as its caller went away
            raise
        finally:
            self._pending.pop(req, None)
            self._queued.discard(req)
            if asked.pop(req, None) is not None and not asked:
                self._asked.pop(principal.id, None)

    def release(self, lease: object, outcome: Outcome, kernels_version: str) -> None:
        assert isinstance(lease, RemoteLease)
        conn, lease.conn = lease.conn, None
        if conn is not None:
            if outcome == Outcome.OK:
                self._park(lease.grant.worker_id, conn)
            else:  # the worker is being replaced, or its reply is still on the way
                conn.close()
        if outcome == Outcome.UNUSED and lease.runs > 1:  # a held lease's call that never reached the worker
            lease.runs, outcome = lease.runs - 1, Outcome.OK
            if lease.handed:
                lease.handoffs_left += 1
            else:
                lease.runs_left += 1
        elif outcome != Outcome.UNUSED:
            lease.kernels = kernels_version
        if outcome == Outcome.OK and self._hand_off(lease):
            return
        if outcome == Outcome.OK and self._may_keep(lease):
            self._park_lease(lease)
            return
        self._give_back(lease, outcome)

    def stop(self, lease: object, within_s: float, kernels_version: str) -> None:
        assert isinstance(lease, RemoteLease)
        conn, lease.conn = lease.conn, None
        if conn is None:  # the run never left: nothing to stop
            self.release(lease, Outcome.UNUSED, kernels_version)
            return
        task = asyncio.get_running_loop().create_task(self._stop(lease, conn, within_s, kernels_version))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stop(self, lease: RemoteLease, conn: _Conn, within_s: float, kernels_version: str) -> None:
        """Half-close the run's connection (the worker stops the guest when it turns readable)
        and read to the worker's answer; the lease, and so the tenant's slot, is held till then."""
        outcome = Outcome.HARD_TIMEOUT
        try:
            async with asyncio.timeout(within_s):
                conn.writer.write_eof()
                while True:
                    msg, _ = await read_frame_async(conn.reader)
                    if not isinstance(msg, Chunk):  # a streamed run's output is nobody's now
                        break
            outcome = outcome_of(msg)
        except TimeoutError:
            pass  # stuck outside the guest's code (a host call): replaced, as at its deadline
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ProtocolError):
            outcome = Outcome.LOST
        finally:
            conn.close()  # half-closed: never pooled
            self.release(lease, outcome, kernels_version)

    # -- held leases ----------------------------------------------------------------------------
    def _oldest_waiting(self, tenant_id: str) -> tuple[int, asyncio.Future[NodeMessage | RemoteLease], float] | None:
        """Take this front's oldest call of the tenant that the supervisor admitted and that still
        waits for a lease (its request, its future, its hard timeout); the supervisor's answer to
        it, if any, is handed back. A request not yet `Queued` may be refused for the rate: it
        must not run."""
        asked = self._asked.get(tenant_id)
        if not asked:
            return None
        req = next((r for r, (fut, _) in asked.items() if r in self._queued and not fut.done()), None)
        if req is None:
            return None
        fut, hard_timeout_s = asked.pop(req)
        if not asked:
            del self._asked[tenant_id]
        self._pending.pop(req, None)
        self._queued.discard(req)
        return req, fut, hard_timeout_s

    def _hand_off(self, lease: RemoteLease) -> bool:
        """Pass the lease to this front's oldest call of its tenant that waits for a lease."""
        if lease.handoffs_left <= 0 or lease.recalled or self._writer is None:
            return False
        tenant_id = lease.grant.token.tenant_id
        if len(self._asked.get(tenant_id, ())) > _HANDOFF_WAITING_MAX:
            return False  # a busy front: grants serve the worker better (_HANDOFF_WAITING_MAX)
        waiting = self._oldest_waiting(tenant_id)
        if waiting is None:
            return False
        lease.handoffs_left -= 1
        lease.runs += 1
        lease.handed = True
        self._give(lease, *waiting)
        return True

    def _give(self, lease: RemoteLease, req: int, fut: asyncio.Future[NodeMessage | RemoteLease], hard_timeout_s: float) -> None:
        """Hand `lease` to the waiting call `req` and tell the supervisor, whose deadline then
        covers that call's hard timeout."""
        lease.hard_timeout_s = hard_timeout_s
        self._send(Handoff(lease.grant.lease_id, req, hard_timeout_s))
        fut.set_result(lease)

    def _pass_grant(self, grant: Granted) -> bool:
        """A grant whose call no longer needs it (served by a handoff as the grant came, or gone)
        serves the next call of its tenant waiting here: told to the supervisor as a handoff, so
        that call's request leaves the queue. Bouncing it back instead would idle its worker for
        two more trips, and at c=256 on 8 fronts most grants crossed a handoff so (a front's oldest
        waiting call is the queue's oldest too)."""
        if self._writer is None:
            return False
        waiting = self._oldest_waiting(grant.token.tenant_id)
        if waiting is None:
            return False
        self._give(self._remote(grant, waiting[2]), *waiting)
        return True

    def _may_keep(self, lease: RemoteLease) -> bool:
        return (
            lease.hold_until > 0 and not lease.recalled and lease.runs_left > 0
            and asyncio.get_running_loop().time() < lease.hold_until and self._writer is not None
        )

    def _take_parked(self, tenant_id: str, hard_timeout_s: float) -> RemoteLease | None:
        stack = self._parked.get(tenant_id)
        while stack:
            lease = stack.pop()
            if not stack:
                del self._parked[tenant_id]
            assert lease.idle is not None
            lease.idle.cancel()
            lease.idle = None
            if self._may_keep(lease) and hard_timeout_s <= lease.hard_timeout_s:
                lease.runs += 1
                lease.runs_left -= 1
                lease.handed = False
                return lease
            self._give_back(lease, Outcome.OK)
        return None

    def _park_lease(self, lease: RemoteLease) -> None:
        loop = asyncio.get_running_loop()
        wait = max(0.0, min(self.idle_s, lease.hold_until - loop.time()))
        lease.idle = loop.call_later(wait, self._unpark, lease)
        self._parked.setdefault(lease.grant.token.tenant_id, []).append(lease)

    def _unpark(self, lease: RemoteLease) -> None:
        """Give back a parked lease (idle too long, its hold over, or recalled)."""
        if lease.idle is None:
            return  # taken by a call meanwhile
        lease.idle.cancel()
        lease.idle = None
        tenant_id = lease.grant.token.tenant_id
        stack = self._parked.get(tenant_id, [])
        if lease in stack:
            stack.remove(lease)
            if not stack:
                del self._parked[tenant_id]
        self._give_back(lease, Outcome.OK)

    def _recalled(self, lease_ids: list[str]) -> None:
        for lease_id in lease_ids:
            lease = self._holding.get(lease_id)
            if lease is None:
                continue  # given back already; the supervisor hears of it
            lease.recalled = True
            if lease.idle is not None:  # parked: back now; in a call: back when it ends
                self._unpark(lease)

    def _give_back(self, lease: RemoteLease, outcome: Outcome) -> None:
        self._holding.pop(lease.grant.lease_id, None)
        with contextlib.suppress(SupervisorGone):
            self._send(ReleaseLease(lease.grant.lease_id, outcome, lease.kernels, lease.runs, lease.runs_left))

    async def check_rate(self, principal: TenantPrincipal) -> None:
        p = self._principal(principal)
        msg = await self._ask(lambda req: RateCheck(req, p))
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
    async def worker_conn(self, grant: Granted) -> _Conn:
        conns = self._pool.get(grant.worker_id)
        while conns:
            conn = conns.pop()
            self._pooled -= 1
            if not conn.reader.at_eof():
                return conn
            conn.close()
        reader, writer = await asyncio.open_unix_connection(grant.socket, limit=1 << 20)
        return _Conn(reader, writer)

    def _park(self, worker_id: str, conn: _Conn) -> None:
        while self._pooled >= _POOL_LIMIT and self._pool:  # oldest worker first: retired ones age out
            oldest = self._pool.pop(next(iter(self._pool)))
            self._pooled -= len(oldest)
            for c in oldest:
                c.close()
        self._pool.setdefault(worker_id, []).append(conn)
        self._pooled += 1
