"""The invoke path: look the function up, lease a worker, exchange the call's bytes with it
directly, release the lease, and say how the run ended.

`Executor` runs one call for every mode (sync, stream, async). Refusals (`Rejected`,
`NoCapacity`) and a missing function pass through to the caller: a client gets 429/503/404 from
the error handlers, queued work retries later. `InvokeService` is the synchronous call: it
records the invocation and gives the router what to answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple

from app.contract.errors import HardTimeout, Rejected, RejectReason, WorkerCrashed
from app.contract.frames import Payload
from app.contract.messages import HostCounts, Outcome, Principal, Refused, RefuseReason, Result, Run, RunStatus
from app.db.ids import new_invocation_id
from app.errors import NotFound
from app.node.deadline import Deadline
from app.node.port import CallLease, NodePort
from app.observability import context as ctx
from app.observability.metrics import Metrics
from app.observability.phases import LOOKUP, METRICS, RECORD, RELEASE, SEND, clock, lap, soon
from app.observability.tracing import Tracing
from app.queue.states import InvocationStatus
from app.scheduler.leases import KernelSet, outcome_of
from app.services.function_cache import FunctionCache, FunctionMeta
from app.services.records import InvocationRecorder
from app.settings import Settings
from app.worker.handle import WorkerLost

log = logging.getLogger(__name__)

_STATUS: dict[RunStatus, InvocationStatus] = {
    RunStatus.OK: InvocationStatus.SUCCEEDED,
    RunStatus.EXIT: InvocationStatus.GUEST_ERROR,
    RunStatus.TRAP: InvocationStatus.GUEST_ERROR,
    RunStatus.ERROR: InvocationStatus.GUEST_ERROR,
    RunStatus.OUTPUT_LIMIT: InvocationStatus.OUTPUT_LIMIT,
    RunStatus.TIMEOUT: InvocationStatus.TIMEOUT,
    RunStatus.DEVICE_ERROR: InvocationStatus.DEVICE_ERROR,
    RunStatus.ARTIFACT_ERROR: InvocationStatus.INTERNAL_ERROR,
    RunStatus.CANCELLED: InvocationStatus.CLIENT_CLOSED,  # the caller is gone by then: only recorded
}

# The synchronous call's answer for each way a run ends: HTTP status and error code.
_ANSWER: dict[InvocationStatus, tuple[int, str]] = {
    InvocationStatus.GUEST_ERROR: (500, "guest_error"),
    InvocationStatus.OUTPUT_LIMIT: (500, "output_limit_exceeded"),
    InvocationStatus.TIMEOUT: (504, "timeout"),
    InvocationStatus.DEVICE_ERROR: (500, "device_error"),
    InvocationStatus.WORKER_CRASHED: (500, "worker_crashed"),
    InvocationStatus.INTERNAL_ERROR: (500, "internal"),
}


def clean_text(text: str | None) -> str | None:
    """PostgreSQL text holds no NUL."""
    return text.replace("\x00", "\ufffd") if text else text


ERROR_CHARS = 1024  # of an invocation's error: its text can carry what a module chose (a name)


def bounded_error(text: str | None) -> str | None:
    return text[: ERROR_CHARS - 1] + "…" if text and len(text) > ERROR_CHARS else text


def stderr_tail(raw: bytes, limit: int) -> str | None:
    """The tail of a guest's stderr as text of at most `limit` UTF-8 bytes (invalid bytes read
    as U+FFFD, three bytes each, would otherwise triple it)."""
    if not raw:
        return None
    text = raw.decode("utf-8", "replace")
    encoded = text.encode()
    return encoded[-limit:].decode("utf-8", "ignore") if len(encoded) > limit else text


def build_run(
    settings: Settings, tenant: Principal, meta: FunctionMeta, name: str, invocation_id: str, query: str, content_type: str,
    args: list[str] | None = None,
) -> Run:
    """The worker's run message for one call; its time limit is the function's own, at most the
    tenant's. The guest's environment is the function's own; the request variables are added
    only to a function deployed with cgi=true (guest_inputs.CGI_VARIABLES), and its secrets'
    values to one deployed with secrets. `args`: the call's
    own argv after the name, else the function's defaults."""
    timeout_ms = min(meta.timeout_ms or tenant.quota.timeout_ms, tenant.quota.timeout_ms)
    env = dict(meta.env)
    env.update(meta.secrets.values)  # opened in this front; the worker gets them as variables only
    if meta.cgi:
        env.update(QUERY_STRING=query, CONTENT_TYPE=content_type, TW_FUNCTION=name, TW_INVOCATION_ID=invocation_id, TW_TENANT=tenant.name)
    return Run(
        invocation_id=invocation_id,
        function=name,
        sha256=meta.sha256,
        env=env,
        timeout_ms=timeout_ms,
        wasm_memory_bytes=tenant.quota.wasm_memory_bytes,
        stdout_limit=settings.stdout_limit_bytes,
        stderr_limit=settings.stderr_tail_bytes,
        args=list(meta.args) if args is None else args,
        files=meta.files,
        scratch_bytes=tenant.quota.scratch_bytes if meta.files and meta.scratch else 0,
    )


@dataclass
class Execution:
    """How one run ended (no HTTP in it)."""

    status: InvocationStatus
    version: int
    content_type: str
    started_at: datetime
    duration_ms: float
    exit_code: int | None = None
    error: str | None = None
    stdout: bytes | memoryview = b""  # a view of the worker's reply: a large output is not copied
    stderr_tail: str | None = None


class Leased(NamedTuple):
    """A lease asked before the call's function was read (`Executor._lease_ahead`)."""

    lease: CallLease
    waited_s: float  # from its request to its grant
    at: float  # its grant, on the monotonic clock


class Executor:
    """Runs one invocation: lookup, lease, exchange with the worker, release.

    Cancelling the caller releases the lease as cancelled: the supervisor kills the worker, so
    the guest stops at once and its reply goes nowhere.
    """

    def __init__(self, settings: Settings, functions: FunctionCache, node: NodePort, metrics: Metrics, tracing: Tracing) -> None:
        self.settings = settings
        self.functions = functions
        self.node = node
        self.metrics = metrics
        self.tracing = tracing

    async def lookup(self, tenant: Principal, name: str, version: int | None = None) -> tuple[FunctionMeta, KernelSet]:
        t = clock()
        cached = self.functions.cached(tenant.id, name) if version is None else None
        if cached is not None:
            lap(LOOKUP, t)
            return cached
        try:  # a read of the database, maybe a compile: not timed
            return await self.functions.lookup(tenant.id, name, version)
        except NotFound:  # a name that does not exist costs a call against the rate too
            await self.node.check_rate(tenant)
            raise

    def _lease_ahead(self, tenant: Principal, name: str, version: int | None) -> asyncio.Task[Leased] | None:
        """For a tenant's first call in this front (no worker of its own in its routes, and its
        function not cached): its lease asked now, so that the spare's bind, or the wait for a
        start, goes on beside the function's read instead of after it. Not for a pinned version
        or a name known to be missing, nor while tracing (the lease's span belongs inside the
        call's). The lease's backstop at the supervisor is the tenant's own time limit: the
        function's, never longer, is not known yet."""
        if version is not None or self.node.routed(tenant.id) or self.tracing.enabled:
            return None
        if self.functions.cached(tenant.id, name) is not None or self.functions.known_missing(tenant.id, name):
            return None
        hard_timeout = (tenant.quota.timeout_ms + self.settings.hard_timeout_grace_ms) / 1000
        return asyncio.create_task(self._timed_lease(tenant, hard_timeout))

    async def _timed_lease(self, tenant: Principal, hard_timeout: float) -> Leased:
        t0 = time.perf_counter()
        lease = await self.node.lease(tenant, hard_timeout, None, check_rate=True)
        return Leased(lease, time.perf_counter() - t0, time.monotonic())

    async def _lookup_beside(
        self, tenant: Principal, name: str, ahead: asyncio.Task[Leased]
    ) -> tuple[FunctionMeta, KernelSet, Leased]:
        """The function read while its lease is asked (`_lease_ahead`). A name that does not
        exist is 404 as ever, once: the lease's admission has counted it against the rate (429
        when over it), and the lease is given back unused."""
        try:
            meta, kernels = await self.functions.lookup(tenant.id, name)
        except NotFound:
            if ahead.done() and not ahead.cancelled() and (refused := ahead.exception()) is not None:
                # refused at its admission: over the rate, answered as the rate check would;
                # any other refusal took no token, so the check takes one now (429 over it)
                if isinstance(refused, Rejected) and refused.reason == RejectReason.RATE:
                    raise refused from None
                await self.node.check_rate(tenant)
                raise
            self._withdraw(ahead)  # admitted: its rate token is taken
            raise
        except BaseException:
            self._withdraw(ahead)
            raise
        try:
            return meta, kernels, await asyncio.shield(ahead)
        except BaseException:
            self._withdraw(ahead)  # the caller went away while the lease was on its way
            raise

    def _withdraw(self, ahead: asyncio.Task[Leased]) -> None:
        """A lease asked ahead for a call that will not run: given back unused once it comes (a
        request still waiting is withdrawn)."""

        def settle(task: asyncio.Task[Leased]) -> None:
            if not task.cancelled() and task.exception() is None:
                self._give_back(task.result())

        if ahead.done():
            settle(ahead)
        else:
            ahead.cancel()
            ahead.add_done_callback(settle)

    def _give_back(self, leased: Leased) -> None:
        """A lease asked ahead that no run will use."""
        self.node.release(leased.lease, Outcome.UNUSED, "")

    async def execute(
        self, tenant: Principal, name: str, invocation_id: str, body: bytes, query: str, content_type: str,
        on_chunk: Callable[[Payload], None] | None = None, args: list[str] | None = None, version: int | None = None,
    ) -> Execution:
        """`version`: the one the call pinned (X-Function-Version), else the active one."""
        if (turn := self.node.turn_ahead(tenant.id)) is not None:  # its tenant queues in this front: a light call first
            await turn
        ahead = self._lease_ahead(tenant, name, version)
        if ahead is None:
            meta, kernels = await self.lookup(tenant, name, version)
            leased = None
        else:
            meta, kernels, leased = await self._lookup_beside(tenant, name, ahead)
            if time.monotonic() - leased.at > self.settings.hard_timeout_grace_ms / 2000:
                # the read outlasted the grant (a compile, a bundle unpacked): the supervisor's
                # backstop for this lease, counted from its grant with the tenant's time limit,
                # could fall inside the run, so the call takes a fresh lease
                self._give_back(leased)
                leased = None
        t = clock()
        try:
            run = build_run(self.settings, tenant, meta, name, invocation_id, query, content_type, args)
        except BaseException:
            if leased is not None:  # held from before the read: nothing else gives it back
                self._give_back(leased)
            raise
        run.stream = on_chunk is not None
        run.kernels_version = kernels.version
        started = datetime.now(UTC)
        t0 = time.perf_counter()
        hard_timeout = (run.timeout_ms + self.settings.hard_timeout_grace_ms) / 1000

        def ended(status: InvocationStatus, host: HostCounts | None = None, **kw: Any) -> Execution:
            seconds = time.perf_counter() - t0
            soon(METRICS, self.metrics.invocation, tenant.name, name, status.value, seconds, host)
            kw["error"] = bounded_error(kw.get("error"))
            if status != InvocationStatus.SUCCEEDED:
                log.info("invocation %s of %s ended %s: %s", invocation_id, name, status.value, kw.get("error"))
            return Execution(status, meta.version, meta.content_type, started, seconds * 1000, **kw)

        try:
            with self.tracing.span("scheduler.run", {"tensorwasm.tenant": tenant.name, "tensorwasm.function": name}):
                run.traceparent = self.tracing.traceparent()  # None when not tracing
                lap(SEND, t)  # the run message (tracing's hooks included, a no-op when off)
                reply, out = await self._call(tenant, run, body, hard_timeout, kernels, on_chunk, leased)
                self.tracing.emit_worker_spans(run.traceparent, reply.spans or [])
        except HardTimeout:
            msg = f"the invocation exceeded its time limit of {run.timeout_ms} ms and its worker was replaced"
            return ended(InvocationStatus.TIMEOUT, error=msg)
        except WorkerCrashed:
            return ended(InvocationStatus.WORKER_CRASHED, error="the worker running this invocation crashed; it has been replaced")
        view = memoryview(out)
        stdout, stderr = view[: reply.stdout_len], bytes(view[reply.stdout_len :])
        error = reply.error
        if reply.status == RunStatus.ARTIFACT_ERROR:
            # the platform's own compiled file is unreadable: discard it, so the next call
            # compiles the function again from its stored module
            self.functions.discard_artifact(tenant.id, name, meta.sha256)
            error = f"{error}; it has been discarded and will be rebuilt, retry the call"
        return ended(
            _STATUS[reply.status], host=reply.host, exit_code=reply.exit_code, error=error, stdout=stdout,
            stderr_tail=stderr_tail(stderr, self.settings.stderr_tail_bytes),
        )

    async def _call(
        self, tenant: Principal, run: Run, body: bytes, hard_timeout: float, kernels: KernelSet,
        on_chunk: Callable[[Payload], None] | None, ahead: Leased | None = None,
    ) -> tuple[Result, Payload]:
        """Lease a worker (or take the one `ahead` leased, with its wait), exchange the call's
        bytes with it directly, release the lease."""
        if ahead is None:
            t0 = time.perf_counter()
            lease = await self.node.lease(tenant, hard_timeout, run.traceparent, check_rate=True)
            leased = time.perf_counter()
            waited = leased - t0
        else:
            lease, waited, leased = ahead.lease, ahead.waited_s, time.perf_counter()
        soon(METRICS, self.metrics.waited, tenant.name, waited)  # counted while the worker runs the call
        outcome: Outcome | None = Outcome.UNUSED  # the caller went away before the run was sent
        try:
            if (turn := self.node.turn(lease)) is not None:  # queued behind its own: a light tenant's calls first
                await turn
            if lease.kernels_version != kernels.version:
                run.kernels = kernels.sources
            outcome = Outcome.CANCELLED  # anything unforeseen mid-exchange: its reply is orphaned
            try:
                # a call sent straight to a worker may queue there first, at most the queue wait
                with Deadline(hard_timeout + lease.wait_s):  # one timer (app/node/deadline.py)
                    reply, out = await lease.exchange(run, body, on_chunk)
                    if isinstance(reply, Refused) and reply.reason == RefuseReason.KERNELS and run.kernels is None:
                        run.kernels = kernels.sources  # the worker holds another set: it takes this one
                        reply, out = await lease.exchange(run, body, on_chunk)
            except Rejected:
                outcome = Outcome.UNUSED  # queued past the queue wait: refused before it started
                raise
            except asyncio.CancelledError:
                # the caller went away mid-call: its guest is stopped and the lease released
                # once the worker answers, so a tenant's disconnects cost no worker starts
                outcome = None
                self.node.stop(lease, max(0.0, hard_timeout - (time.perf_counter() - leased)), kernels.version)
                raise
            except TimeoutError:
                outcome = Outcome.HARD_TIMEOUT
                raise HardTimeout() from None
            except WorkerLost:
                outcome = Outcome.LOST
                raise WorkerCrashed() from None
            outcome = outcome_of(reply)
            if not isinstance(reply, Result):
                log.error("worker answered a run with %s", reply)
                raise WorkerCrashed()
            soon(METRICS, self.metrics.ran, tenant.name, reply.duration_ms / 1000)
        finally:
            if outcome is not None:
                t = clock()
                self.node.release(lease, outcome, kernels.version)
                lap(RELEASE, t)
        if (turn := self.node.turn(lease)) is not None:  # and once more before it answers
            try:
                await turn
            except asyncio.CancelledError:
                # the run is over and released: it stands as it ended (a caller gone meanwhile
                # just gets no answer), never recorded as cut short
                task = asyncio.current_task()
                assert task is not None
                task.uncancel()
        return reply, out


@dataclass
class InvokeOutcome:
    invocation_id: str
    status: int
    body: bytes | memoryview
    content_type: str
    error: dict[str, Any] | None = None


class InvokeService:
    """One synchronous call: run it, record it, and say what to answer."""

    def __init__(self, executor: Executor, recorder: InvocationRecorder) -> None:
        self.executor = executor
        self.recorder = recorder

    async def invoke(
        self, tenant: Principal, name: str, body: bytes, query: str, content_type: str, args: list[str] | None = None,
        version: int | None = None,
    ) -> InvokeOutcome:
        invocation_id = new_invocation_id()
        ctx.invocation_id.set(invocation_id)
        created = datetime.now(UTC)
        t0 = time.perf_counter()
        try:
            ex = await self.executor.execute(tenant, name, invocation_id, body, query, content_type, args=args, version=version)
        except asyncio.CancelledError:
            # the caller went away (the route cancels the call): the guest was stopped with its
            # worker; recorded as such, not as an error
            seconds = time.perf_counter() - t0
            self.executor.metrics.invocation(tenant.name, name, InvocationStatus.CLIENT_CLOSED.value, seconds, None)
            self._record(tenant.id, name, invocation_id, created, {
                "status": InvocationStatus.CLIENT_CLOSED.value, "version": None, "started_at": created,
                "duration_ms": seconds * 1000, "exit_code": None,
                "error": "the client closed the connection before the answer", "stderr_tail": None,
            })
            raise
        soon(RECORD, self._record_execution, tenant.id, name, invocation_id, created, ex)  # once the answer is written
        if ex.status == InvocationStatus.SUCCEEDED:
            return InvokeOutcome(invocation_id, 200, ex.stdout, ex.content_type)
        http, code = _ANSWER[ex.status]
        err: dict[str, Any] = {"code": code, "message": ex.error or ex.status.value}
        if ex.exit_code is not None:
            err["exit_code"] = ex.exit_code
        if ex.stderr_tail:
            err["stderr_tail"] = ex.stderr_tail[-4096:]
        return InvokeOutcome(invocation_id, http, b"", "", err)

    def _record_execution(self, tenant_id: str, name: str, invocation_id: str, created: datetime, ex: Execution) -> None:
        self._record(tenant_id, name, invocation_id, created, {
            "status": ex.status.value, "version": ex.version, "started_at": ex.started_at, "duration_ms": ex.duration_ms,
            "exit_code": ex.exit_code, "error": clean_text(ex.error), "stderr_tail": clean_text(ex.stderr_tail),
        })

    def _record(self, tenant_id: str, name: str, invocation_id: str, created: datetime, values: dict[str, Any]) -> None:
        self.recorder.record({"id": invocation_id, "tenant_id": tenant_id, "function": name, "created_at": created, **values})
