"""The invoke path: cached function metadata, the scheduler call, result mapping, and
invocation records written in batches off the hot path."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.api.errors import ApiError, not_found
from app.db.repositories.api_keys import ApiKeyRepository
from app.db.repositories.functions import FunctionRepository
from app.db.repositories.invocations import InvocationRepository
from app.db.repositories.kernels import KernelRepository
from app.db.models import Function
from app.observability import context as ctx
from app.queue.states import InvocationStatus
from app.observability.metrics import Metrics
from app.observability.tracing import Tracing
from app.runtime.compiler import ModuleCompiler
from app.scheduler.scheduler import HardTimeout, KernelSet, NoCapacity, Rejected, Scheduler, WorkerCrashed
from app.services.functions import compile_errors
from app.services.principal import TenantPrincipal
from app.settings import Settings

log = logging.getLogger(__name__)

# Status of an invocation whose caller disconnected before its answer.
CLIENT_CLOSED = "client_closed"


@dataclass(frozen=True)
class FunctionMeta:
    name: str
    version: int
    sha256: str
    env: dict[str, str]
    content_type: str
    timeout_ms: int | None
    artifact: Path
    expires: float


class FunctionCache:
    """(tenant, function) -> what a worker needs to run it; deploys on this node invalidate.

    Entries used recently are re-read in the background before they expire (`refresh`), so only
    a tenant's first call, or its first after minutes of silence, reads the database. A local
    change (deploy, delete, kernel upload) bumps the entry's generation, and a refresh that read
    the database before that change does not overwrite it.

    Only functions that exist are kept fresh, at most `max_entries` of them (least recently used
    go first); a name that does not exist is remembered as missing for one TTL (a deploy on this
    node clears that at once), so a stream of made-up names costs bounded memory, one read per
    name and TTL, and no background work.
    """

    def __init__(
        self, sessionmaker: async_sessionmaker[AsyncSession], compiler: ModuleCompiler, ttl_s: float, max_entries: int = 10_000
    ) -> None:
        self.sessionmaker = sessionmaker
        self.compiler = compiler
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._fns: dict[tuple[str, str], FunctionMeta] = {}
        self._kernels: dict[str, tuple[float, KernelSet]] = {}
        self._kernel_versions: dict[str, int] = {}
        self._used: dict[tuple[str, str], float] = {}  # found functions, least recently used first
        self._missing: dict[tuple[str, str], float] = {}  # names found missing -> until when
        self._gen: dict[object, int] = {}  # (tenant, name) or tenant -> local change counter

    async def lookup(self, tenant_id: str, name: str) -> tuple[FunctionMeta, KernelSet]:
        """The function and the tenant's kernels; on a miss, both reads run concurrently."""
        key = (tenant_id, name)
        now = time.monotonic()
        meta = self._fns.get(key)
        hit = self._kernels.get(tenant_id)
        if meta is not None and meta.expires > now and hit is not None and hit[0] > now:
            self._touch(key, now)
            return meta, hit[1]  # the hot path: no task, no await
        self._check_missing(key, now)
        meta, kernels = await asyncio.gather(self.function(tenant_id, name), self.kernels(tenant_id))
        self._touch(key, time.monotonic())
        return meta, kernels

    def _touch(self, key: tuple[str, str], now: float) -> None:
        used = self._used
        used.pop(key, None)  # re-inserted at the end: the dict's order is the LRU order
        used[key] = now
        if len(used) > self.max_entries:
            del used[next(iter(used))]

    def _check_missing(self, key: tuple[str, str], now: float) -> None:
        until = self._missing.get(key)
        if until is not None:
            if until > now:
                raise not_found(f"function {key[1]!r}")
            del self._missing[key]

    def _note_missing(self, key: tuple[str, str]) -> None:
        self._missing.pop(key, None)
        self._missing[key] = time.monotonic() + self.ttl_s
        if len(self._missing) > self.max_entries:
            del self._missing[next(iter(self._missing))]

    async def function(self, tenant_id: str, name: str) -> FunctionMeta:
        key = (tenant_id, name)
        now = time.monotonic()
        meta = self._fns.get(key)
        if meta is not None and meta.expires > now:
            return meta
        self._check_missing(key, now)
        gen = self._gen.get(key, 0)
        async with self.sessionmaker() as session:
            meta = await self._load_function(session, tenant_id, name)
        if meta is None:
            if self._gen.get(key, 0) == gen:
                self._note_missing(key)
            raise not_found(f"function {name!r}")
        if self._gen.get(key, 0) == gen:
            self._fns[key] = meta
        return meta

    async def _load_function(self, session: AsyncSession, tenant_id: str, name: str) -> FunctionMeta | None:
        repo = FunctionRepository(session, tenant_id)
        fn = await repo.get(name)
        if fn is None:
            return None
        ver = await repo.version_meta(fn, fn.current_version)
        if ver is None:
            return None
        sha = ver[0]
        if not self.compiler.cache.has(sha):  # deployed through another node
            wasm = await repo.module_bytes(fn, fn.current_version)
            assert wasm is not None
            with compile_errors():
                await self.compiler.ensure_artifact(tenant_id, sha, wasm)
        return self.meta_for(fn, sha)

    async def kernels(self, tenant_id: str) -> KernelSet:
        hit = self._kernels.get(tenant_id)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        gen = self._gen.get(tenant_id, 0)
        async with self.sessionmaker() as session:
            sources = await KernelRepository(session, tenant_id).sources()
        return self._store_kernels(tenant_id, sources, gen)

    def _store_kernels(self, tenant_id: str, sources: dict[str, str], gen: int) -> KernelSet:
        hit = self._kernels.get(tenant_id)
        old = hit[1] if hit else None
        if old is not None and old.sources == sources:
            ks = old  # unchanged: keep the version, so workers are not sent the sources again
        else:
            version = self._kernel_versions.get(tenant_id, 0) + 1
            self._kernel_versions[tenant_id] = version
            ks = KernelSet(version, sources)
        if self._gen.get(tenant_id, 0) == gen:
            self._kernels[tenant_id] = (time.monotonic() + self.ttl_s, ks)
        return ks

    async def refresh(self, keep_s: float) -> None:
        """Re-read every function used within `keep_s` and its tenant's kernels; forget the rest."""
        now = time.monotonic()
        self._used = {k: t for k, t in self._used.items() if now - t <= keep_s}
        self._missing = {k: t for k, t in self._missing.items() if t > now}
        for key in [k for k in self._fns if k not in self._used]:
            del self._fns[key]
        tenants = {t for t, _ in self._used}
        for tenant_id in [t for t in self._kernels if t not in tenants]:
            del self._kernels[tenant_id]
        if not self._used:
            return
        async with self.sessionmaker() as session:
            for key in list(self._used):
                gen = self._gen.get(key, 0)
                try:
                    meta = await self._load_function(session, *key)
                except ApiError:  # its module cannot be compiled here now; its calls say so
                    meta = None
                if self._gen.get(key, 0) != gen:
                    continue  # changed on this node while we read: the local entry is newer
                if meta is None:  # deleted elsewhere: stop keeping it fresh
                    self._fns.pop(key, None)
                    self._used.pop(key, None)
                    self._note_missing(key)
                else:
                    self._fns[key] = meta
            for tenant_id in tenants:
                gen = self._gen.get(tenant_id, 0)
                self._store_kernels(tenant_id, await KernelRepository(session, tenant_id).sources(), gen)

    def _bump(self, key: object) -> None:
        self._gen[key] = self._gen.get(key, 0) + 1

    def remember(self, tenant_id: str, meta: FunctionMeta) -> None:
        """Prime the cache at deploy, so the first call after a deploy skips the database."""
        key = (tenant_id, meta.name)
        self._bump(key)
        self._missing.pop(key, None)  # a name just deployed here is no longer missing
        self._fns[key] = meta
        self._touch(key, time.monotonic())

    def meta_for(self, fn: Function, sha256: str) -> FunctionMeta:
        return FunctionMeta(
            name=fn.name,
            version=fn.current_version,
            sha256=sha256,
            env=dict(fn.env or {}),
            content_type=fn.content_type,
            timeout_ms=fn.timeout_ms,
            artifact=self.compiler.cache.path_for(sha256),
            expires=time.monotonic() + self.ttl_s,
        )

    def drop(self, tenant_id: str, name: str) -> None:
        self._bump((tenant_id, name))
        self._fns.pop((tenant_id, name), None)
        self._used.pop((tenant_id, name), None)

    def discard_artifact(self, tenant_id: str, name: str, sha256: str) -> None:
        """Forget a compiled file a worker could not load; the next lookup recompiles it."""
        self.compiler.cache.path_for(sha256).unlink(missing_ok=True)
        self.drop(tenant_id, name)

    def drop_kernels(self, tenant_id: str) -> None:
        self._bump(tenant_id)
        self._kernels.pop(tenant_id, None)

    def drop_tenant(self, tenant_id: str) -> None:
        for key in [k for k in self._fns if k[0] == tenant_id]:
            self.drop(*key)
        self.drop_kernels(tenant_id)


class InvocationRecorder:
    """Buffers invocation records and writes them in batches; callers never wait on the DB."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], interval_s: float, batch: int) -> None:
        self.sessionmaker = sessionmaker
        self.interval_s = interval_s
        self.batch = batch
        self._pending: list[dict[str, Any]] = []
        self._touched: dict[str, datetime] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.dropped = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        # Let a flush in progress finish rather than cancel it mid-transaction: a cancelled write
        # can keep its SQLite connection's lock while the final flush below needs it.
        if self._task is not None:
            self._stopping = True
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout=10)
            except TimeoutError:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        await self.flush()

    def touch_key(self, key_id: str, when: datetime) -> None:
        """Note an API key's use; `last_used_at` is written with the next batch."""
        self._touched[key_id] = when

    def record(self, row: dict[str, Any]) -> None:
        self._pending.append(row)
        if len(self._pending) >= self.batch:
            self._wake.set()

    async def _loop(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            try:
                await self.flush()
            except Exception:
                log.exception("writing invocation records failed; will retry")

    async def flush(self) -> None:
        async with self._lock:
            if self._touched:
                touched, self._touched = self._touched, {}
                async with self.sessionmaker() as session:
                    repo = ApiKeyRepository(session)
                    for key_id, when in touched.items():
                        await repo.touch(key_id, when)
                    await session.commit()
            if not self._pending:
                return
            rows, self._pending = self._pending, []
            try:
                async with self.sessionmaker() as session:
                    await InvocationRepository(session).insert_many(rows)
                    await session.commit()
            except IntegrityError:
                # A tenant deleted while its call ran: its record has nowhere to go. Write the
                # batch row by row so every other record still lands.
                await self._insert_each(rows)
            except Exception:
                # keep them for the next try, bounded so a dead database cannot exhaust memory
                keep = rows[-50_000:]
                self.dropped += len(rows) - len(keep)
                self._pending = keep + self._pending
                raise

    async def _insert_each(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            try:
                async with self.sessionmaker() as session:
                    await InvocationRepository(session).insert_many([row])
                    await session.commit()
            except IntegrityError:
                self.dropped += 1
                log.info("dropped the record of invocation %s: its tenant no longer exists", row["id"])


@dataclass
class InvokeOutcome:
    invocation_id: str
    status: int
    body: bytes
    content_type: str
    error: dict[str, Any] | None = None
    headers: dict[str, str] | None = None


_STATUS = {
    "ok": (200, "succeeded", None),
    "exit": (500, "guest_error", "guest_error"),
    "trap": (500, "guest_error", "guest_error"),
    "error": (500, "guest_error", "guest_error"),
    "output_limit": (500, "output_limit", "output_limit_exceeded"),
    "timeout": (504, "timeout", "timeout"),
    "device_error": (500, "device_error", "device_error"),
    "artifact_error": (500, "internal_error", "internal"),
}


def _rate_limited(exc: Rejected) -> ApiError:
    return ApiError(429, "rate_limited", exc.message, {"Retry-After": str(exc.retry_after)})


def run_header(
    settings: Settings, tenant: TenantPrincipal, meta: FunctionMeta, name: str, invocation_id: str, query: str, content_type: str
) -> tuple[dict[str, Any], int]:
    """The worker's `run` request for one call, and the call's time limit in ms (the function's
    own, at most the tenant's)."""
    timeout_ms = min(meta.timeout_ms or tenant.quota.timeout_ms, tenant.quota.timeout_ms)
    env = dict(meta.env)
    env.update(TW_FUNCTION=name, TW_INVOCATION_ID=invocation_id, TW_TENANT=tenant.name, QUERY_STRING=query, CONTENT_TYPE=content_type)
    header: dict[str, Any] = {
        "op": "run",
        "invocation_id": invocation_id,
        "function": name,
        "sha256": meta.sha256,
        "env": env,
        "timeout_ms": timeout_ms,
        "wasm_memory_bytes": tenant.quota.wasm_memory_bytes,
        "stdout_limit": settings.stdout_limit_bytes,
        "stderr_limit": settings.stderr_tail_bytes,
    }
    return header, timeout_ms


class InvokeService:
    def __init__(self, settings: Settings, functions: FunctionCache, scheduler: Scheduler, recorder: InvocationRecorder, metrics: Metrics, tracing: Tracing) -> None:
        self.settings = settings
        self.functions = functions
        self.scheduler = scheduler
        self.recorder = recorder
        self.metrics = metrics
        self.tracing = tracing

    async def invoke(self, tenant: TenantPrincipal, name: str, body: bytes, query: str, content_type: str) -> InvokeOutcome:
        try:
            self.scheduler.check_rate(tenant)  # before the lookup: a name that does not exist costs a call too
        except Rejected as exc:
            raise _rate_limited(exc) from None
        meta, kernels = await self.functions.lookup(tenant.id, name)
        invocation_id = uuid.uuid4().hex
        ctx.invocation_id.set(invocation_id)
        header, timeout_ms = run_header(self.settings, tenant, meta, name, invocation_id, query, content_type)
        started = datetime.now(timezone.utc)
        t0 = time.perf_counter()
        hard_timeout = (timeout_ms + self.settings.hard_timeout_grace_ms) / 1000
        record: dict[str, Any] = {
            "id": invocation_id,
            "tenant_id": tenant.id,
            "function": name,
            "version": meta.version,
            "created_at": started,
            "started_at": started,
            "exit_code": None,
            "stderr_tail": None,
        }
        try:
            with self.tracing.span("scheduler.run", {"tensorwasm.tenant": tenant.name, "tensorwasm.function": name}):
                traceparent = self.tracing.traceparent()  # None when not tracing
                if traceparent:
                    header["traceparent"] = traceparent
                reply, out, _ = await self.scheduler.run(tenant, header, body, hard_timeout, kernels)
                self.tracing.emit_worker_spans(traceparent, reply.get("spans") or [])
        except Rejected as exc:
            raise _rate_limited(exc) from None
        except NoCapacity as exc:
            raise ApiError(503, "no_capacity", f"{exc}; retry later", {"Retry-After": "1"}) from None
        except HardTimeout:
            msg = f"the invocation exceeded its time limit of {timeout_ms} ms and its worker was replaced"
            self._finish(record, "timeout", t0, tenant.name, error=msg)
            return InvokeOutcome(invocation_id, 504, b"", "", {"code": "timeout", "message": msg})
        except WorkerCrashed:
            msg = "the worker running this invocation crashed; it has been replaced, retry the call"
            self._finish(record, "worker_crashed", t0, tenant.name, error=msg)
            return InvokeOutcome(invocation_id, 500, b"", "", {"code": "worker_crashed", "message": msg})
        except asyncio.CancelledError:
            # the caller went away (the route cancels the call): the guest was stopped with its
            # worker; recorded as such, not as an error
            self._finish(record, CLIENT_CLOSED, t0, tenant.name, error="the client closed the connection before the answer")
            raise

        stdout_len = int(reply.get("stdout_len", 0))
        stdout, stderr = out[:stdout_len], out[stdout_len:]
        stderr_tail = stderr.decode("utf-8", "replace") if stderr else None
        http, status, code = _STATUS.get(reply.get("status", "error"), _STATUS["error"])
        if reply.get("status") == "artifact_error":
            # the platform's own compiled file is unreadable: discard it, so the next call
            # compiles the function again from its stored module
            self.functions.discard_artifact(tenant.id, name, meta.sha256)
            reply = {**reply, "error": f"{reply.get('error')}; it has been discarded and will be rebuilt, retry the call"}
        self._finish(record, status, t0, tenant.name, exit_code=reply.get("exit_code"), error=reply.get("error"), stderr=stderr_tail, host=reply.get("host"))
        if code is None:
            return InvokeOutcome(invocation_id, 200, stdout, meta.content_type)
        err: dict[str, Any] = {"code": code, "message": reply.get("error") or status}
        if reply.get("exit_code") is not None:
            err["exit_code"] = reply["exit_code"]
        if stderr_tail:
            err["stderr_tail"] = stderr_tail[-4096:]
        return InvokeOutcome(invocation_id, http, b"", "", err)

    def _finish(
        self, record: dict[str, Any], status: str, t0: float, tenant: str, exit_code: int | None = None,
        error: str | None = None, stderr: str | None = None, host: dict[str, Any] | None = None,
    ) -> None:
        seconds = time.perf_counter() - t0
        self.metrics.invocation(tenant, record["function"], status, seconds, host)
        if status != "succeeded":
            log.info("invocation %s of %s ended %s: %s", record["id"], record["function"], status, error)
        record.update(
            status=status,
            duration_ms=seconds * 1000,
            exit_code=exit_code,
            error=error.replace("\x00", "\ufffd") if error else error,  # PostgreSQL text holds no NUL
            stderr_tail=stderr.replace("\x00", "\ufffd") if stderr else stderr,
        )
        self.recorder.record(record)


@dataclass
class Execution:
    """How one run ended, for the async runner and the streaming route (no HTTP in it)."""

    status: InvocationStatus
    version: int
    content_type: str
    started_at: datetime
    duration_ms: float
    exit_code: int | None = None
    error: str | None = None
    stdout: bytes = b""
    stderr_tail: str | None = None


class Executor:
    """Runs one invocation through the scheduler's `run` and maps its reply to an Execution.

    Rejected and NoCapacity pass through (the caller decides: 429/503 for a client, a later
    retry for queued work); cancelling the caller kills the guest's worker (the scheduler's rule).
    """

    def __init__(self, settings: Settings, functions: FunctionCache, scheduler: Scheduler, metrics: Metrics, tracing: Tracing) -> None:
        self.settings = settings
        self.functions = functions
        self.scheduler = scheduler
        self.metrics = metrics
        self.tracing = tracing

    async def execute(
        self, tenant: TenantPrincipal, name: str, invocation_id: str, body: bytes, query: str, content_type: str,
        on_chunk: Callable[[bytes], None] | None = None,
    ) -> Execution:
        self.scheduler.check_rate(tenant)  # before the lookup: a name that does not exist costs a call too
        meta, kernels = await self.functions.lookup(tenant.id, name)
        header, timeout_ms = run_header(self.settings, tenant, meta, name, invocation_id, query, content_type)
        if on_chunk is not None:
            header["stream"] = True
        started = datetime.now(timezone.utc)
        t0 = time.perf_counter()
        hard_timeout = (timeout_ms + self.settings.hard_timeout_grace_ms) / 1000

        def ended(status: InvocationStatus, **kw: Any) -> Execution:
            seconds = time.perf_counter() - t0
            self.metrics.invocation(tenant.name, name, status.value, seconds, kw.pop("host", None))
            return Execution(status, meta.version, meta.content_type, started, seconds * 1000, **kw)

        try:
            with self.tracing.span("scheduler.run", {"tensorwasm.tenant": tenant.name, "tensorwasm.function": name}):
                traceparent = self.tracing.traceparent()
                if traceparent:
                    header["traceparent"] = traceparent
                reply, out, _ = await self.scheduler.run(tenant, header, body, hard_timeout, kernels, on_chunk=on_chunk)
                self.tracing.emit_worker_spans(traceparent, reply.get("spans") or [])
        except HardTimeout:
            msg = f"the invocation exceeded its time limit of {timeout_ms} ms and its worker was replaced"
            return ended(InvocationStatus.TIMEOUT, error=msg)
        except WorkerCrashed:
            return ended(InvocationStatus.WORKER_CRASHED, error="the worker running this invocation crashed; it has been replaced")
        stdout_len = int(reply.get("stdout_len", 0))
        stdout, stderr = out[:stdout_len], out[stdout_len:]
        _, status, _ = _STATUS.get(reply.get("status", "error"), _STATUS["error"])
        error = reply.get("error")
        if reply.get("status") == "artifact_error":
            self.functions.discard_artifact(tenant.id, name, meta.sha256)
            error = f"{error}; it has been discarded and will be rebuilt"
        return ended(
            InvocationStatus(status), exit_code=reply.get("exit_code"), error=error, stdout=stdout,
            stderr_tail=stderr.decode("utf-8", "replace") if stderr else None, host=reply.get("host"),
        )
