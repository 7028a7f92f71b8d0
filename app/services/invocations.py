"""The invoke path: look the function up, lease a worker, exchange the call's bytes with it,
release the lease, map the result and record it."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from app.api.errors import ApiError
from app.contract.errors import HardTimeout, WorkerCrashed
from app.contract.messages import HostCounts, Outcome, Result, Run, RunStatus
from app.node.port import NodePort
from app.observability import context as ctx
from app.observability.metrics import Metrics
from app.observability.tracing import Tracing
from app.scheduler.leases import KernelSet, outcome_of
from app.services.function_cache import FunctionCache
from app.services.principal import TenantPrincipal
from app.services.records import InvocationRecorder
from app.settings import Settings
from app.worker.client import WorkerLost

log = logging.getLogger(__name__)


@dataclass
class InvokeOutcome:
    invocation_id: str
    status: int
    body: bytes
    content_type: str
    error: dict[str, Any] | None = None
    headers: dict[str, str] | None = None


_STATUS: dict[RunStatus, tuple[int, str, str | None]] = {
    RunStatus.OK: (200, "succeeded", None),
    RunStatus.EXIT: (500, "guest_error", "guest_error"),
    RunStatus.TRAP: (500, "guest_error", "guest_error"),
    RunStatus.ERROR: (500, "guest_error", "guest_error"),
    RunStatus.OUTPUT_LIMIT: (500, "output_limit", "output_limit_exceeded"),
    RunStatus.TIMEOUT: (504, "timeout", "timeout"),
    RunStatus.DEVICE_ERROR: (500, "device_error", "device_error"),
    RunStatus.ARTIFACT_ERROR: (500, "internal_error", "internal"),
}


class InvokeService:
    """One synchronous call: look the function up, lease a worker, exchange the call's bytes
    with it, release the lease, record. Refusals (Rejected, NoCapacity) propagate to the
    routers' error handlers."""

    def __init__(self, settings: Settings, functions: FunctionCache, node: NodePort, recorder: InvocationRecorder, metrics: Metrics, tracing: Tracing) -> None:
        self.settings = settings
        self.functions = functions
        self.node = node
        self.recorder = recorder
        self.metrics = metrics
        self.tracing = tracing

    async def invoke(self, tenant: TenantPrincipal, name: str, body: bytes, query: str, content_type: str) -> InvokeOutcome:
        try:
            meta, kernels = await self.functions.lookup(tenant.id, name)
        except ApiError as exc:
            if exc.status == 404:  # a name that does not exist costs a call against the rate too
                await self.node.check_rate(tenant)
            raise
        invocation_id = uuid.uuid4().hex
        ctx.invocation_id.set(invocation_id)
        timeout_ms = min(meta.timeout_ms or tenant.quota.timeout_ms, tenant.quota.timeout_ms)
        env = dict(meta.env)
        env.update(
            TW_FUNCTION=name,
            TW_INVOCATION_ID=invocation_id,
            TW_TENANT=tenant.name,
            QUERY_STRING=query,
            CONTENT_TYPE=content_type,
        )
        run = Run(
            invocation_id=invocation_id,
            function=name,
            sha256=meta.sha256,
            env=env,
            timeout_ms=timeout_ms,
            wasm_memory_bytes=tenant.quota.wasm_memory_bytes,
            stdout_limit=self.settings.stdout_limit_bytes,
            stderr_limit=self.settings.stderr_tail_bytes,
            kernels_version=kernels.version,
        )
        started = datetime.now(timezone.utc)
        t0 = time.perf_counter()
        hard_timeout = (timeout_ms + self.settings.hard_timeout_grace_ms) / 1000
        record: dict[str, Any] = {
            "id": invocation_id,
            "tenant_id": tenant.id,
            "function": name,
            "version": meta.version,
            "started_at": started,
            "exit_code": None,
            "stderr_tail": None,
        }
        try:
            with self.tracing.span("scheduler.run", {"tensorwasm.tenant": tenant.name, "tensorwasm.function": name}):
                run.traceparent = self.tracing.traceparent()  # None when not tracing
                reply, out = await self._call(tenant, run, body, hard_timeout, kernels)
                self.tracing.emit_worker_spans(run.traceparent, reply.spans or [])
        except HardTimeout:
            msg = f"the invocation exceeded its time limit of {timeout_ms} ms and its worker was replaced"
            self._finish(record, "timeout", t0, tenant.name, error=msg)
            return InvokeOutcome(invocation_id, 504, b"", "", {"code": "timeout", "message": msg})
        except WorkerCrashed:
            msg = "the worker running this invocation crashed; it has been replaced, retry the call"
            self._finish(record, "worker_crashed", t0, tenant.name, error=msg)
            return InvokeOutcome(invocation_id, 500, b"", "", {"code": "worker_crashed", "message": msg})

        stdout, stderr = out[: reply.stdout_len], out[reply.stdout_len :]
        stderr_tail = stderr.decode("utf-8", "replace") if stderr else None
        http, status, code = _STATUS[reply.status]
        error = reply.error
        if reply.status == RunStatus.ARTIFACT_ERROR:
            # the platform's own compiled file is unreadable: discard it, so the next call
            # compiles the function again from its stored module
            self.functions.discard_artifact(tenant.id, name, meta.sha256)
            error = f"{error}; it has been discarded and will be rebuilt, retry the call"
        self._finish(record, status, t0, tenant.name, exit_code=reply.exit_code, error=error, stderr=stderr_tail, host=reply.host)
        if code is None:
            return InvokeOutcome(invocation_id, 200, stdout, meta.content_type)
        err: dict[str, Any] = {"code": code, "message": error or status}
        if reply.exit_code is not None:
            err["exit_code"] = reply.exit_code
        if stderr_tail:
            err["stderr_tail"] = stderr_tail[-4096:]
        return InvokeOutcome(invocation_id, http, b"", "", err)

    async def _call(self, tenant: TenantPrincipal, run: Run, body: bytes, hard_timeout: float, kernels: KernelSet) -> tuple[Result, bytes]:
        """Lease a worker, exchange the call's bytes with it directly, release the lease."""
        lease = await self.node.lease(tenant, hard_timeout, run.traceparent, check_rate=True)
        outcome = Outcome.CANCELLED  # unless the exchange ends: the caller went away mid-call
        try:
            if lease.kernels_version != kernels.version:
                run.kernels = kernels.sources
            try:
                async with asyncio.timeout(hard_timeout):  # no extra task, unlike wait_for
                    reply, out = await lease.exchange(run, body)
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
            return reply, out
        finally:
            self.node.release(lease, outcome, kernels.version)

    def _finish(
        self, record: dict[str, Any], status: str, t0: float, tenant: str, exit_code: int | None = None,
        error: str | None = None, stderr: str | None = None, host: HostCounts | None = None,
    ) -> None:
        seconds = time.perf_counter() - t0
        self.metrics.invocation(tenant, record["function"], status, seconds, host)
        if status != "succeeded":
            log.info("invocation %s of %s ended %s: %s", record["id"], record["function"], status, error)
        record.update(
            status=status,
            duration_ms=seconds * 1000,
            exit_code=exit_code,
            error=error,
            stderr_tail=stderr,
        )
        self.recorder.record(record)
