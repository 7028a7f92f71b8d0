"""A front's warm call path: admitted in the node's shared admission table and sent straight to
one of the tenant's bound workers, without asking the supervisor (docs/architecture.md, "The
call path").

The supervisor pushes each tenant's workers (`Routes`) to every front when they change. A call
of a tenant with routes takes one step in the table (rate, calls in flight, the worker with the
shortest queue), goes to that worker over a pooled connection, and gives its counts back when
the reply is in. The worker runs the calls of all fronts one at a time, in the order they come.

A worker that dies or refuses a route's token is dropped from this front's routes, and a call
it had not started is sent again, to another worker of the tenant or, with none left, through a
lease from the supervisor (which binds one). Whether a call had started is read from the
worker's stats page (app/worker/stats.py), so a crash fails only the call that was running.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from app.contract.errors import NoCapacity, Rejected, RejectReason
from app.contract.frames import Payload, ProtocolError
from app.contract.messages import Outcome, Refused, RefuseReason, Route, Run, WorkerMessage
from app.node.deadline import Deadline
from app.observability.phases import SEND, clock, lap
from app.worker.handle import WorkerLost
from app.worker.stats import StatsPage, run_mark

if TYPE_CHECKING:
    from app.contract.messages import Principal
    from app.node.supervisor_client import RemoteLease, SupervisorClient
    from app.node.worker_conn import WorkerConnection

_ATTEMPTS = 3  # a call not started is sent again this many times at most (workers retired meanwhile)


@dataclass(eq=False)
class RoutedWorker:
    """One worker of a tenant as this front reaches it."""

    route: Route
    page: StatsPage | None
    kernels_version: str = ""  # what this front last saw it hold (it may hold another: it says so)
    gone: bool = False

    @classmethod
    def of(cls, route: Route) -> RoutedWorker:
        page = None
        with contextlib.suppress(OSError, ValueError):  # gone already: its calls are sent elsewhere
            page = StatsPage(Path(route.page), create=False)
        return cls(route, page)

    def started(self, invocation_id: str) -> bool:
        """Whether the worker took this call (running it or done with it): unknown counts as yes,
        so a call that may have run is never run twice."""
        if self.page is None:
            return True
        mark = run_mark(invocation_id)
        try:
            return self.page.get("running") == mark or self.page.get("last_done") == mark
        except ValueError:  # closed
            return True



@dataclass(eq=False)
class DirectLease:
    """A call admitted in the table and held by one routed worker's queue (or, once the tenant has
    no routed worker left, by a lease from the supervisor)."""

    client: SupervisorClient
    principal: Principal
    slot: int  # the tenant's entry in the admission table
    worker: RoutedWorker | None
    queue_slot: int  # the worker's slot in the table (its queue), -1 once off every queue
    hard_timeout_s: float
    traceparent: str | None
    wait_s: float  # the longest a call may queue at a worker before it starts
    conn: WorkerConnection | None = None
    remote: RemoteLease | None = None
    tried: set[str] = field(default_factory=set)
    invocation_id: str = ""
    depth: int = 0  # the calls queued at its worker before it when admitted
    routed: int = 0  # the tenant's workers this front routed to when it was admitted
    shared: bool = False  # counted in the front's share (app/node/front_share.py) until released
    # its place in the tenant's order: admitted then, it may start until then + wait_s (a call
    # sent again keeps its place)
    admitted_at: float = field(default_factory=time.monotonic)

    @property
    def kernels_version(self) -> str:
        if self.remote is not None:
            return self.remote.kernels_version
        return self.worker.kernels_version if self.worker is not None else ""

    async def exchange(self, run: Run, body: bytes, on_chunk: Callable[[Payload], None] | None = None) -> tuple[WorkerMessage, Payload]:
        self.invocation_id = run.invocation_id
        for _ in range(_ATTEMPTS):
            if self.remote is not None:
                return await self.remote.exchange(run, body, on_chunk)
            worker = self.worker
            assert worker is not None
            run.lease = worker.route.token
            run.start_by = self.admitted_at + self.wait_s
            try:
                msg, out = await self._send(worker, run, body, on_chunk)
            except WorkerLost:
                if worker.started(run.invocation_id):
                    raise
                self.client.worker_failed(worker, Outcome.LOST)
                await self._reroute(run)
                continue
            if isinstance(msg, Refused):
                if msg.reason == RefuseReason.LATE:
                    raise self._late()
                if msg.reason == RefuseReason.TOKEN:  # retired or replaced: not the tenant's any more
                    self.client.forget_worker(self.principal.id, worker)
                    await self._reroute(run)
                    continue
            if isinstance(msg, Refused) and msg.reason == RefuseReason.KERNELS:
                worker.kernels_version = ""  # unknown: the caller sends the sources
            return msg, out
        raise WorkerLost(f"no worker of tenant {self.principal.name} took the call after {_ATTEMPTS} tries")

    async def _send(self, worker: RoutedWorker, run: Run, body: bytes, on_chunk: Callable[[Payload], None] | None) -> tuple[WorkerMessage, Payload]:
        t = clock()
        # Still queued at its start_by, the call is given up here (the worker would refuse it):
        # its deadline cancels the call's task, told apart from any other cancellation (with
        # asyncio.timeout around this, the step cost 6.2-7.7 us more than its bare await on the
        # dev VM under uvloop; with one timer 2.7-3.7)
        late = Deadline(run.start_by - time.monotonic(), lambda: not worker.started(run.invocation_id))
        try:
            with late:
                lap(SEND, t)  # its deadline set (a connection opened below is a wait)
                self.conn = conn = self.conn or await self.client.route_conn(worker.route)  # sent again: the same connection
                return await conn.exchange(run, body, on_chunk)
        except (OSError, EOFError, ProtocolError) as exc:  # IncompleteReadError is an EOFError
            self._drop_conn()
            if late.expired and isinstance(exc, TimeoutError):
                raise self._late() from None
            raise WorkerLost(f"worker {worker.route.worker_id}: {exc}") from exc

    def _late(self) -> Rejected:
        """Still waiting at its worker at its start_by: refused as a call that waited out its queue wait."""
        limit, waited = self.principal.quota.max_concurrency, f"{self.wait_s * 1000:.0f} ms"
        if self.routed >= limit:  # as many workers as it may run calls, each busy
            why = f"tenant is at its concurrency limit ({limit} running) and its call waited longer than this node's queue wait ({waited})"
        else:  # under its limit, but no spare to grow into: its workers' calls came first
            why = (
                f"the call waited longer than this node's queue wait ({waited}) behind the tenant's other calls on its "
                f"{self.routed} busy worker(s) (its concurrency limit is {limit}; this node had no worker to add)"
            )
        return Rejected(RejectReason.CONCURRENCY, f"{why}; retry shortly", 1)

    def _drop_conn(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    async def _reroute(self, run: Run) -> None:
        """Another of the tenant's workers for a call none has started, or a supervisor's lease."""
        assert self.worker is not None
        self.tried.add(self.worker.route.worker_id)
        self._drop_conn()
        nxt = self.client.reroute(self, self.tried)
        if nxt is None:
            self.worker, self.queue_slot = None, -1
            # The caller's hard timer counts this wait (it allows wait_s before the run): a lease
            # that came later would leave the run less than its time limit, so this call (unlike
            # a first call, which asks before the timer starts) waits for a start only till then.
            try:
                async with asyncio.timeout(max(0.0, self.admitted_at + self.wait_s - time.monotonic())):
                    self.remote = await self.client.remote_lease(self.principal, self.hard_timeout_s, self.traceparent)
            except TimeoutError:
                raise NoCapacity("the tenant's workers went away and no other was bound within this node's queue wait") from None
            run.start_by = 0.0  # a lease's worker is the call's alone
