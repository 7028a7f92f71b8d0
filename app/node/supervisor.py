"""The supervisor of a node of several fronts (docs/architecture.md, "Processes" and "The call path").

It binds the node's TCP port, runs the scheduler (workers through the fork server), serves
leases to the fronts over a unix socket in a private run directory, and starts N front
processes that serve HTTP on the inherited listening socket. It restarts a front that dies.

A lease's life: a front asks (`LeaseRequest`: tenant, quota, hard deadline, traceparent); the
scheduler admits the call node-wide (rate, concurrency, fair share, queue) and binds a worker;
the supervisor answers `Granted` with the worker's socket and a token (HMAC of the lease, the
worker and the tenant under a per-node key the workers got at bind); the front sends the run to
the worker itself and reads the result; it then sends `ReleaseLease` with the outcome.

That is the cold path: a tenant's first call, and any call of a tenant with no bound worker.
Once bound, the tenant's workers are pushed to every front (`Routes`) and its calls go straight
from the fronts to them, admitted in the node's shared admission table (app/node/admission.py,
created here): the supervisor sees no message of a warm call. It hears a front's `Grow` (the
tenant's calls queue at all its workers) and `WorkerFailed` (replace it), and it reads the table
before it retires a worker.

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
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest

from app.contract.errors import NoCapacity, Rejected
from app.contract.frames import ProtocolError
from app.contract.messages import (
    Changed,
    ChangeKind,
    CompileDone,
    CompileSlot,
    Granted,
    Grow,
    Hello,
    LeaseRequest,
    LeaseToken,
    NodeMessage,
    Outcome,
    Principal,
    RateCheck,
    RateOk,
    Refusal,
    RefusalKind,
    ReleaseLease,
    Route,
    Routes,
    SlotGranted,
    View,
    ViewKind,
    ViewReply,
    WithdrawLease,
    WorkerFailed,
    lease_mac,
)
from app.node.admission import ADMISSION_FILE, AdmissionTable, sweep_tables, table_path
from app.node.ipc import MessageProtocol, pack
from app.node.serve import CannotListen
from app.node.serve import listener as listen_on
from app.node.startup import freeze_startup_heap, log_serving
from app.observability.metrics import attach_scheduler
from app.observability.stalls import StallWatch, stall_histograms
from app.observability.tracing import Tracing
from app.sandbox.limiter import FairLimiter
from app.scheduler.leases import Lease, Waiting
from app.scheduler.scheduler import Scheduler
from app.settings import Settings

log = logging.getLogger(__name__)

# How long a stopping front may take before it is killed: it writes the records it holds first
# (app/services/records.py: a flush under way up to 10 s, then its last batch up to 5 s). With
# 10 s here, an H200 host killed a front still writing its backlog: 51,680 records lost.
FRONT_STOP_S = 20.0


RUN_DIR_PREFIX = "tensorwasm-node-"


def sweep_run_dirs(base: Path) -> None:
    """Remove the run directories of supervisors that no longer run (killed, so never cleaned)."""
    for path in base.glob(f"{RUN_DIR_PREFIX}*"):
        pid = path.name.removeprefix(RUN_DIR_PREFIX).split("-", 1)[0]
        if pid.isdigit() and path.owner() == getpass.getuser() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


@dataclass(eq=False)
class _Held:
    """A lease granted to a front, with its deadline."""

    lease: Lease
    timer: asyncio.TimerHandle


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
        # the admission table in shared memory, reached by fronts through a link in the run dir
        sweep_tables()
        self.table = AdmissionTable.create(
            table_path(), settings.processes, settings.admission_tenants, 4 * settings.max_workers + 64
        )
        (self.run_dir / ADMISSION_FILE).symlink_to(self.table.path)
        self.scheduler.pool.table = self.table
        self.scheduler.on_routes = self._publish_routes
        self.registry = CollectorRegistry(auto_describe=True)
        attach_scheduler(self.registry, self.scheduler)
        self.front_restarts = Counter("tensorwasm_front_restarts", "Front processes started again after they died", registry=self.registry)
        self._leases = Counter("tensorwasm_leases", "Leases granted to fronts, one per call", registry=self.registry)
        # a warm call sends none: what a tenant's steady state costs the supervisor shows here
        self._messages = Counter(
            "tensorwasm_supervisor_messages", "Messages from fronts the supervisor handled, by kind", ["kind"], registry=self.registry
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
        try:
            listener = listen_on(self.host, self.port)  # CannotListen: one line for the command line
        except CannotListen:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.table.close()
            self.table.path.unlink(missing_ok=True)
            raise
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
            self.table.close()
            self.table.path.unlink(missing_ok=True)
        return 0

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _keep_front(self, index: int, listener: socket.socket) -> None:
        """Run front `index`; start it again whenever it dies, until the node stops."""
        failures = 0
        while not self._stopping.is_set():
            self.table.reclaim(index)  # what a front of this index that died still counted
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
            async with asyncio.timeout(FRONT_STOP_S):
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
        self._messages.labels(type(msg).__name__).inc()
        if isinstance(msg, LeaseRequest):
            self._lease_request(front, msg)
        elif isinstance(msg, ReleaseLease):
            self._release(front, msg.lease_id, msg.outcome, msg.kernels_version)
        elif isinstance(msg, WithdrawLease):
            if (waiting := front.waiting.pop(msg.req, None)) is not None:
                self.scheduler.withdraw(waiting)
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
                self.scheduler.check_rate(msg.principal)
                front.send(RateOk(msg.req))
            except Rejected as exc:
                self._refuse(front, msg.req, exc)
        elif isinstance(msg, View):
            front.send(self._view(msg))
        elif isinstance(msg, Changed) and msg.kind == ChangeKind.APPLIED:
            self._applied(front, msg.token)
        elif isinstance(msg, Changed):
            self._changed(front, msg)
        elif isinstance(msg, Grow):
            self.scheduler.grow(msg.principal)
        elif isinstance(msg, WorkerFailed):
            self.scheduler.worker_failed(msg.worker_id, msg.outcome)
        elif isinstance(msg, Hello):
            front.index, front.pid = msg.front, msg.pid
            for tenant_id in list(self.scheduler.tenants):  # a front started again: the routes now
                front.send(self._routes(tenant_id))

    # -- routes -----------------------------------------------------------------------------------
    def _routes(self, tenant_id: str) -> Routes:
        routes = []
        for w in self.scheduler.routed(tenant_id):
            if w.socket_path is None or w.stats is None:
                continue
            token = LeaseToken("", tenant_id, lease_mac(self.secret, "", w.id, tenant_id))
            routes.append(Route(w.id, w.socket_path, w.slot, str(w.stats.path), token))
        return Routes(tenant_id, routes)

    def _publish_routes(self, tenant_id: str) -> None:
        msg = self._routes(tenant_id)
        for front in self.fronts:
            front.send(msg)

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
        principal = msg.principal
        with self.tracing.span_in(msg.traceparent, "scheduler.lease", {"tensorwasm.tenant": principal.name, "tensorwasm.wait": False}):
            try:
                lease = self.scheduler.lease_now(principal, check_rate=msg.check_rate)
            except Rejected as exc:
                self._refuse(front, msg.req, exc)
                return
        if lease is not None:
            self._granted(front, msg, lease)
            return
        if self.tracing.enabled:  # the wait in a task, so that its span covers it
            task = asyncio.get_running_loop().create_task(self._lease(front, msg, principal))
            front.asking.add(task)
            task.add_done_callback(front.asking.discard)
            return
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

    async def _lease(self, front: _Front, msg: LeaseRequest, principal: Principal) -> None:
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
        # the front times the call itself; this is the backstop for a front that never answers
        grace = self.settings.hard_timeout_grace_ms / 1000
        timer = asyncio.get_running_loop().call_later(msg.hard_timeout_s + grace, self._overdue, front, lease.id)
        front.leases[lease.id] = _Held(lease, timer)
        self._leases.inc()
        w = lease.worker
        assert w.socket_path is not None
        token = LeaseToken(lease.id, principal.id, lease_mac(self.secret, lease.id, w.id, principal.id))
        front.send(Granted(msg.req, lease.id, w.id, w.socket_path, token, lease.kernels_version))

    def _overdue(self, front: _Front, lease_id: str) -> None:
        if lease_id in front.leases:
            log.warning("front %d held lease %s past its hard deadline; killing its worker", front.index, lease_id)
            self._release(front, lease_id, Outcome.HARD_TIMEOUT, "")

    def _release(self, front: _Front, lease_id: str, outcome: Outcome, kernels_version: str) -> None:
        held = front.leases.pop(lease_id, None)
        if held is None:
            return  # already taken back (deadline) or never granted
        held.timer.cancel()
        self.scheduler.release(held.lease, outcome, kernels_version)

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
