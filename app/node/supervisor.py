"""The supervisor of a node of several fronts (DESIGN.md section 1).

It binds the node's TCP port, runs the scheduler (workers through the fork server), serves
leases to the fronts over a unix socket in a private run directory, and starts N front
processes that serve HTTP on the inherited listening socket. It restarts a front that dies.

A lease's life: a front asks (`LeaseRequest`: tenant, quota, hard deadline, traceparent); the
scheduler admits the call node-wide (rate, concurrency, fair share, queue) and binds a worker;
the supervisor answers `Granted` with the worker's socket and a token (HMAC of the lease, the
worker and the tenant under a per-node key the workers got at bind); the front sends the run to
the worker itself and reads the result; it then sends `ReleaseLease` with the outcome.

Held leases: a lease granted at once while no call waits anywhere on the node may be kept by its
front for more calls of the tenant (`Granted.hold_s`, `TENSORWASM_LEASE_HOLD_MS`), so a warm
tenant's calls do not come here one by one. Those calls are paid for at the grant (up to the
tenant's rate over the hold, from the upper half of its burst; what is not used is given back at
the release), the worker admits at most that many runs on the token, and the deadline below
covers the hold. As soon as a call has to wait, the held leases that could serve it are recalled
(`Recall`): those of its tenant, and every tenant's when it waits for anything but its own
concurrency limit; a call that holds its slot and waits for a worker (a bind, an eviction)
recalls every held lease again, and none is granted for holding while any call waits for either.
So FIFO within a tenant, the fair share and evictions work as before.

Handoffs under load: a lease may also carry up to `TENSORWASM_LEASE_HANDOFF_RUNS` calls when its
front has more calls of the tenant waiting (`Granted.handoffs`). As a call ends, the front passes
the worker to its own oldest waiting call and says so (`Handoff`): that call's request leaves the
queue here and takes over the slot, and the lease's deadline is set again for it. Only a request
admitted here (rate, queue limit) and said so (`Queued`) may be handed a lease; a busy tenant's
worker then goes from call to call without a release and a grant between them. A front passes
leases on only while few calls of the tenant wait in it (app/node/client.py says why). Within a
tenant a front may serve its own calls before older ones of other fronts, at most `handoff runs`
calls a lease; no handoff is granted, and those granted are recalled, while another tenant's call
waits for a worker slot or a call waits for a worker to be bound, so the fair share and evictions
are untouched.

The supervisor holds each lease to its hard deadline too: a front that never releases has its
worker killed. A front whose connection drops has its leases released as cancelled (their
workers are killed mid-call: the replies have nowhere to go) and its queued calls withdrawn.
Everything the supervisor starts dies with it (parent-death signals), so a killed supervisor
leaves no process of the node behind.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import getpass
import itertools
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, generate_latest

from app.contract.errors import NoCapacity, Rejected
from app.contract.frames import ProtocolError
from app.contract.messages import (
    Changed,
    ChangeKind,
    CompileDone,
    CompileSlot,
    Granted,
    Handoff,
    Hello,
    LeaseRequest,
    LeaseToken,
    NodeMessage,
    Outcome,
    Principal,
    Queued,
    RateCheck,
    RateOk,
    Recall,
    Refusal,
    RefusalKind,
    ReleaseLease,
    SlotGranted,
    View,
    ViewKind,
    ViewReply,
    lease_mac,
)
from app.node.ipc import MessageProtocol, pack
from app.node.startup import freeze_startup_heap, log_serving
from app.observability.metrics import attach_scheduler
from app.observability.stalls import StallWatch, stall_histograms
from app.observability.tracing import Tracing
from app.sandbox.limiter import FairLimiter
from app.scheduler.fairness import Blocked
from app.scheduler.leases import Lease, Waiting
from app.scheduler.scheduler import Scheduler
from app.services.principal import TenantPrincipal, TenantQuota
from app.settings import Settings

log = logging.getLogger(__name__)


RUN_DIR_PREFIX = "tensorwasm-node-"


def sweep_run_dirs(base: Path) -> None:
    """Remove the run directories of supervisors that no longer run (killed, so never cleaned)."""
    for path in base.glob(f"{RUN_DIR_PREFIX}*"):
        pid = path.name.removeprefix(RUN_DIR_PREFIX).split("-", 1)[0]
        if pid.isdigit() and path.owner() == getpass.getuser() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


@functools.lru_cache(maxsize=16384)
def _principal(p: Principal) -> TenantPrincipal:
    """The scheduler's view of a lease request's tenant. Cached by value (the struct is frozen,
    its quota included): a lease is the hot path, and the conversion cost ~10x the lookup."""
    q = p.quota
    return TenantPrincipal(
        p.id,
        p.name,
        TenantQuota(**msgspec.structs.asdict(q)),
    )


@dataclass(eq=False)
class _Held:
    """A lease granted to a front, with its deadline; `hold`: the front may keep it for more calls."""

    lease: Lease
    timer: asyncio.TimerHandle
    hold_until: float = 0.0  # (event-loop time) the end of its hold; 0: not held
    handoff: bool = False  # the front may pass it to its own waiting calls of the tenant
    recalled: bool = False

    @property
    def hold(self) -> bool:
        return self.hold_until > 0


@dataclass(eq=False)
class _Front:
    """One front's IPC connection and what it holds."""

    transport: asyncio.Transport
    index: int = -1
    pid: int = 0
    leases: dict[str, _Held] = field(default_factory=dict)
    unapplied: set[str] = field(default_factory=set)  # change tokens this front has yet to answer
    compiling: collections.Counter[str] = field(default_factory=collections.Counter)  # compile slots held, by tenant
    asking: set[asyncio.Task[None]] = field(default_factory=set)
    waiting: dict[int, Waiting] = field(default_factory=dict)  # queued lease requests, by req
    closed: bool = False

    def send(self, msg: NodeMessage) -> None:
        if not self.closed:
            self.transport.write(pack(msg))


class Supervisor:
    def __init__(self, settings: Settings, host: str, port: int) -> None:
        self.settings = settings
        self.host, self.port = host, port
        base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()  # short socket paths
        sweep_run_dirs(Path(base))
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-", dir=base))  # 0700
        self.metrics_dir = self.run_dir / "metrics"
        self.metrics_dir.mkdir(mode=0o700)
        self.ipc_path = str(self.run_dir / "supervisor.sock")
        self.secret = secrets.token_bytes(32)
        self.scheduler = Scheduler(settings, self.secret, self.run_dir)
        self.scheduler.on_worker_wait = lambda: self._recall_where(lambda held: True)  # an eviction may need any worker
        self.registry = CollectorRegistry(auto_describe=True)
        attach_scheduler(self.registry, self.scheduler)
        self.front_restarts = Counter("tensorwasm_front_restarts", "Front processes started again after they died", registry=self.registry)
        leases = Counter("tensorwasm_leases", "Leases granted to fronts; held: kept by the front for further calls", ["held"], registry=self.registry)
        self._granted_one, self._granted_held = leases.labels(held="false"), leases.labels(held="true")
        self._handoffs = Counter(
            "tensorwasm_lease_handoffs", "Calls a front ran on a lease it passed on from the tenant's previous call", registry=self.registry,
        )
        self.stalls = StallWatch(*stall_histograms(self.registry, "tensorwasm_supervisor"))
        self.tracing = Tracing(settings)
        self.fronts: set[_Front] = set()
        self.front_procs: dict[int, asyncio.subprocess.Process] = {}
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._change_seq = itertools.count(1)
        # compiles run in the fronts' sandboxes; who may compile is decided here, node-wide
        self.compile_limiter = FairLimiter(settings.compile_concurrency)
        self._change_waits: dict[str, asyncio.Future[None]] = {}

    # -- lifecycle ----------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.create_server((self.host, self.port), family=family, backlog=4096)
        listener.set_inheritable(True)
        server = await loop.create_unix_server(self._front_protocol, path=self.ipc_path)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        try:
            await self.scheduler.start(wait=True)
            for i in range(self.settings.processes):
                self._spawn_task(self._keep_front(i, listener))
            log_serving(self.scheduler, self.settings, self.settings.processes)
            log.info("node listening on http://%s:%d", self.host, self.port)
            freeze_startup_heap()
            self.stalls.start()
            await self._stopping.wait()
        finally:
            await self.stalls.stop()
            await self._stop_fronts()
            server.close()
            listener.close()
            await self.scheduler.stop()
            self.tracing.shutdown()
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return 0

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _keep_front(self, index: int, listener: socket.socket) -> None:
        """Run front `index`; start it again whenever it dies, until the node stops."""
        failures = 0
        while not self._stopping.is_set():
            env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir), "TENSORWASM_ADMIN_TOKEN": self.settings.admin_token or ""}
            # started from the event loop's thread: the front's parent-death signal follows it
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "app.node.front",
                "--fd", str(listener.fileno()), "--ipc", self.ipc_path, "--index", str(index), "--parent-pid", str(os.getpid()),
                pass_fds=(listener.fileno(),), env=env, stdin=asyncio.subprocess.DEVNULL,
            )
            self.front_procs[index] = proc
            code = await proc.wait()
            if self._stopping.is_set():
                return
            self.front_restarts.inc()
            failures += 1
            log.error("front %d (pid %d) exited with %s; starting it again", index, proc.pid, code)
            await asyncio.sleep(min(5.0, 0.1 * 2 ** min(failures, 6)))

    async def _stop_fronts(self) -> None:
        procs = [p for p in self.front_procs.values() if p.returncode is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        try:
            async with asyncio.timeout(10):
                await asyncio.gather(*(p.wait() for p in procs))
        except TimeoutError:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        for t in list(self._tasks):
            t.cancel()

    # -- one front's connection -----------------------------------------------------------------
    def _front_protocol(self) -> MessageProtocol:
        front: _Front | None = None

        def made(transport: asyncio.Transport) -> None:
            nonlocal front
            front = _Front(transport)
            self.fronts.add(front)

        def message(msg: NodeMessage) -> None:
            assert front is not None
            self._on_message(front, msg)

        def lost(exc: Exception | None) -> None:
            assert front is not None
            if isinstance(exc, ProtocolError):
                log.error("front %d sent garbage: %s", front.index, exc)
            self._front_gone(front)

        return MessageProtocol(made, message, lost)

    def _on_message(self, front: _Front, msg: NodeMessage) -> None:
        if isinstance(msg, LeaseRequest):
            self._lease_request(front, msg)
        elif isinstance(msg, ReleaseLease):
            self._release(front, msg.lease_id, msg.outcome, msg.kernels_version, msg.runs, msg.unused)
        elif isinstance(msg, Handoff):
            self._handoff(front, msg)
        elif isinstance(msg, CompileSlot):
            task = asyncio.get_running_loop().create_task(self._compile_slot(front, msg))
            front.asking.add(task)
            task.add_done_callback(front.asking.discard)
        elif isinstance(msg, CompileDone):
            if front.compiling[msg.tenant_id] > 0:
                front.compiling[msg.tenant_id] -= 1
                self.compile_limiter.release(msg.tenant_id)
        elif isinstance(msg, RateCheck):
            try:
                self.scheduler.check_rate(_principal(msg.principal))
                front.send(RateOk(msg.req))
            except Rejected as exc:
                self._refuse(front, msg.req, exc)
        elif isinstance(msg, View):
            front.send(self._view(msg))
        elif isinstance(msg, Changed) and msg.kind == ChangeKind.APPLIED:
            self._applied(front, msg.token)
        elif isinstance(msg, Changed):
            self._changed(front, msg)
        elif isinstance(msg, Hello):
            front.index, front.pid = msg.front, msg.pid

    def _front_gone(self, front: _Front) -> None:
        """Its calls are lost: workers mid-call are replaced, queued calls withdrawn."""
        front.closed = True
        self.fronts.discard(front)
        for task in list(front.asking):
            task.cancel()  # a queued lease gives its slot back (Scheduler.lease)
        for waiting in list(front.waiting.values()):
            self.scheduler.withdraw(waiting)
        front.waiting.clear()
        for lease_id in list(front.leases):
            self._release(front, lease_id, Outcome.CANCELLED, "")
        for token in list(front.unapplied):  # it will never answer: do not wait for it
            self._applied(front, token)
        for tenant_id, held in front.compiling.items():  # its compile processes died with it
            for _ in range(held):
                self.compile_limiter.release(tenant_id)
        front.compiling.clear()
        with contextlib.suppress(Exception):
            front.transport.close()

    def _lease_request(self, front: _Front, msg: LeaseRequest) -> None:
        """Grant at once when the tenant has an idle worker and may run; else queue the request."""
        principal = _principal(msg.principal)
        with self.tracing.span_in(msg.traceparent, "scheduler.lease", {"tensorwasm.tenant": principal.name, "tensorwasm.wait": False}):
            try:
                lease = self.scheduler.lease_now(principal, check_rate=msg.check_rate)
            except Rejected as exc:
                self._refuse(front, msg.req, exc)
                return
        if lease is not None:
            self._granted(front, msg, lease)
            return
        self._recall(principal)
        if self.tracing.enabled:  # the wait in a task, so that its span covers it
            task = asyncio.get_running_loop().create_task(self._lease(front, msg, principal))
            front.asking.add(task)
            task.add_done_callback(front.asking.discard)
            return  # never `Queued`: a traced call waits for its own grant
        # no task while it waits: the release that frees a slot grants it (Scheduler.queue_lease)
        try:
            waiting = self.scheduler.queue_lease(
                principal,
                lambda lease: self._granted(front, msg, lease),
                lambda exc: self._refuse(front, msg.req, exc),
            )
        except Rejected as exc:
            self._refuse(front, msg.req, exc)
            return
        if waiting.pending:  # else granted or refused already
            front.waiting[msg.req] = waiting
            if self.settings.lease_handoff_runs > 1:
                front.send(Queued(msg.req))  # admitted: its front may hand it a lease

    async def _lease(self, front: _Front, msg: LeaseRequest, principal: TenantPrincipal) -> None:
        try:
            with self.tracing.span_in(msg.traceparent, "scheduler.lease", {"tensorwasm.tenant": principal.name, "tensorwasm.wait": True}):
                lease = await self.scheduler.lease(principal)  # the rate was taken by lease_now
        except (Rejected, NoCapacity) as exc:
            self._refuse(front, msg.req, exc)
            return
        self._granted(front, msg, lease)

    @staticmethod
    def _refuse(front: _Front, req: int, exc: Exception) -> None:
        front.waiting.pop(req, None)
        if isinstance(exc, Rejected):
            front.send(Refusal(req, RefusalKind.REJECTED, exc.message, exc.reason.value, exc.retry_after))
        else:
            front.send(Refusal(req, RefusalKind.NO_CAPACITY, str(exc)))

    def _granted(self, front: _Front, msg: LeaseRequest, lease: Lease) -> None:
        principal = lease.tenant.principal
        front.waiting.pop(msg.req, None)
        if front.closed:
            self.scheduler.release(lease, Outcome.CANCELLED)
            return
        hold_s, runs = self.settings.lease_hold_ms / 1000, 1
        if hold_s > 0 and msg.check_rate and self.scheduler.waiting() == 0:  # held only while no call waits
            runs += self.scheduler.prepay(lease, int(principal.quota.requests_per_second * hold_s))
        if runs == 1:
            hold_s = 0.0
        handoffs = self.settings.lease_handoff_runs - 1
        if handoffs > 0 and self.scheduler.contended(principal.id):
            handoffs = 0
        # the front times each call itself; this is the backstop for a front that never answers
        # (it starts no call on a held lease past hold_s, and each call ends by its hard timeout)
        now = asyncio.get_running_loop().time()
        timer = self._deadline(front, lease.id, now + hold_s, msg.hard_timeout_s)
        front.leases[lease.id] = _Held(lease, timer, now + hold_s if hold_s > 0 else 0.0, handoffs > 0)
        (self._granted_held if hold_s > 0 else self._granted_one).inc()
        w = lease.worker
        assert w.socket_path is not None
        runs += handoffs
        token = LeaseToken(lease.id, principal.id, lease_mac(self.secret, lease.id, w.id, principal.id, runs), runs)
        front.send(Granted(msg.req, lease.id, w.id, w.socket_path, token, lease.kernels_version, hold_s, handoffs))

    def _handoff(self, front: _Front, msg: Handoff) -> None:
        """The front passed a lease to its own queued request `msg.req`: that request leaves the
        queue (its call was admitted when it asked) and the lease's deadline now covers its call."""
        held = front.leases.get(msg.lease_id)
        if held is None:
            return  # taken back at its deadline: the worker is gone, and the call fails with it
        waiting = front.waiting.pop(msg.req, None)
        if waiting is not None:
            self.scheduler.withdraw(waiting)
        # else: granted another lease meanwhile (the front passes it on or gives it back), or
        # refused at its queue wait as the handoff came: it was admitted, and runs all the same
        self._handoffs.inc()
        held.timer.cancel()
        held.timer = self._deadline(front, msg.lease_id, max(asyncio.get_running_loop().time(), held.hold_until), msg.hard_timeout_s)

    def _deadline(self, front: _Front, lease_id: str, last_start: float, hard_timeout_s: float) -> asyncio.TimerHandle:
        """The backstop for a front that never answers: a call may start on the lease until
        `last_start` (event-loop time) and ends by its hard timeout; past both and the grace,
        its worker is killed."""
        grace = self.settings.hard_timeout_grace_ms / 1000
        return asyncio.get_running_loop().call_at(last_start + hard_timeout_s + grace, self._overdue, front, lease_id)

    def _recall(self, principal: TenantPrincipal) -> None:
        """A call of this tenant has to wait: recall the held leases that could serve it (its
        tenant's; every tenant's unless it waits for its own concurrency limit), and other
        tenants' handoffs when it waits for a worker slot only (`FairShare.starved`)."""
        tenant_id = principal.id
        holds = self.settings.lease_hold_ms > 0
        own_limit = holds and self.scheduler.fair.running(tenant_id) >= principal.quota.max_concurrency
        starved = self.settings.lease_handoff_runs > 1 and self.scheduler.fair.blocked(tenant_id) == Blocked.NO_CAPACITY
        if not holds and not starved:
            return  # nothing it may take back: no walk over every lease
        self._recall_where(
            lambda held: (held.hold and (not own_limit or held.lease.tenant.principal.id == tenant_id))
            or (starved and held.handoff and held.lease.tenant.principal.id != tenant_id)
        )

    def _recall_where(self, which: Callable[[_Held], bool]) -> None:
        if self.settings.lease_hold_ms == 0 and self.settings.lease_handoff_runs <= 1:
            return  # no lease is held: every waiting call would walk every lease for nothing
        for front in self.fronts:
            ids = []
            for lease_id, held in front.leases.items():
                if (held.hold or held.handoff) and not held.recalled and which(held):
                    held.recalled = True
                    ids.append(lease_id)
            if ids:
                front.send(Recall(ids))

    def _recall_tenant(self, tenant_id: str) -> None:
        """The tenant changed (quota, disabled, deleted): no front runs more calls on what it holds."""
        self._recall_where(lambda held: held.lease.tenant.principal.id == tenant_id)

    def _overdue(self, front: _Front, lease_id: str) -> None:
        if lease_id in front.leases:
            log.warning("front %d held lease %s past its hard deadline; killing its worker", front.index, lease_id)
            self._release(front, lease_id, Outcome.HARD_TIMEOUT, "")

    def _release(self, front: _Front, lease_id: str, outcome: Outcome, kernels_version: str, runs: int = 1, unused: int = 0) -> None:
        held = front.leases.pop(lease_id, None)
        if held is None:
            return  # already taken back (deadline) or never granted
        held.timer.cancel()
        self.scheduler.release(held.lease, outcome, kernels_version, runs, unused)

    async def _compile_slot(self, front: _Front, msg: CompileSlot) -> None:
        await self.compile_limiter.acquire(msg.tenant_id)  # cancelled when the front goes
        if front.closed:
            self.compile_limiter.release(msg.tenant_id)
            return
        front.compiling[msg.tenant_id] += 1
        front.send(SlotGranted(msg.req, msg.tenant_id))

    def _changed(self, origin: _Front, msg: Changed) -> None:
        if msg.kind == ChangeKind.TENANT:
            self.scheduler.tenant_changed(msg.tenant_id)
            self._recall_tenant(msg.tenant_id)
        if msg.req:
            self._spawn_task(self._change_fronts(origin, msg))
            return
        for front in self.fronts:
            if front is not origin:
                front.send(msg)

    async def _change_fronts(self, origin: _Front, msg: Changed) -> None:
        """Forward a change to every other front; answer the origin once all applied it (or 2 s:
        a stopped front must not hold an admin call)."""
        token = f"{next(self._change_seq)}"
        others = [f for f in self.fronts if f is not origin and not f.closed]
        done = self._change_waits[token] = asyncio.get_running_loop().create_future()
        for f in others:
            f.unapplied.add(token)
            f.send(Changed(msg.kind, msg.tenant_id, msg.name, token=token))
        try:
            if others:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done, 2.0)
        finally:
            self._change_waits.pop(token, None)
            for f in others:
                f.unapplied.discard(token)
        origin.send(ViewReply(msg.req))

    def _applied(self, front: _Front, token: str) -> None:
        front.unapplied.discard(token)
        done = self._change_waits.get(token)
        if done is not None and not done.done() and not any(token in f.unapplied for f in self.fronts):
            done.set_result(None)

    def _view(self, msg: View) -> ViewReply:
        s = self.scheduler
        if msg.kind == ViewKind.USAGE:
            return ViewReply(msg.req, usage=s.usage(msg.tenant_id))
        if msg.kind == ViewKind.WORKERS:
            return ViewReply(msg.req, workers=s.worker_infos())
        if msg.kind == ViewKind.READY:
            return ViewReply(msg.req, readiness=s.readiness())
        if msg.kind == ViewKind.METRICS:
            return ViewReply(msg.req, metrics=generate_latest(self.registry))
        return ViewReply(msg.req, queue_depth=s.queue_depth())


def run_supervisor(settings: Settings, host: str, port: int) -> int:
    async def main() -> int:
        return await Supervisor(settings, host, port).run()

    try:
        import uvloop  # with uvicorn[standard]: the fronts' loop too; halves the lease round trip
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())
