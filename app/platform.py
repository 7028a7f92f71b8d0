"""The long-lived objects of one api process (a front, or the whole one-process node), built in
the app lifespan."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from app.contract.messages import ChangeKind
from app.db.models import utcnow
from app.runtime.compiler import ModuleCompiler
from app.services.api_keys import AuthCache
from app.services.auth_failures import AuthFailures
from app.services.body_budget import BodyBudget
from app.settings import Settings

if TYPE_CHECKING:
    from app.node.port import NodePort
    from app.observability.metrics import Metrics
    from app.observability.tracing import Tracing
    from app.queue.runner import QueueRunner
    from app.queue.service import AsyncInvocations
    from app.scheduler.scheduler import Scheduler
    from app.services.callbacks import CallbackDispatcher, CallbackSecrets
    from app.services.function_cache import FunctionCache
    from app.services.invocations import Executor
    from app.services.logs import Logs
    from app.services.records import InvocationRecorder


@dataclass
class Platform:
    settings: Settings
    engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    compiler: ModuleCompiler
    auth_cache: AuthCache
    function_cache: FunctionCache
    recorder: InvocationRecorder
    scheduler: Scheduler | None  # in-process (one-process node); None in a front
    node: NodePort
    metrics: Metrics
    tracing: Tracing
    bodies: BodyBudget  # request bodies each tenant holds in this process
    auth_failures: AuthFailures  # failed authentications per client address, in this process
    clock: Callable[[], datetime] = field(default=utcnow)
    executor: Executor = field(default=None)  # type: ignore[assignment]  # runs one call (async, stream)
    queue: AsyncInvocations = field(default=None)  # type: ignore[assignment]  # submit/cancel/output
    # drains the queue: in the one-process node, or in the first front of a node of several
    queue_runner: QueueRunner | None = None
    logs: Logs = field(default=None)  # type: ignore[assignment]  # function logs, read
    callback_secrets: CallbackSecrets = field(default=None)  # type: ignore[assignment]
    callbacks: CallbackDispatcher | None = None  # sends callbacks: next to the queue runner

    async def tenant_changed(self, tenant_id: str) -> None:
        """Drop everything cached about a tenant after an admin change on this node."""
        self.apply_change(ChangeKind.TENANT, tenant_id)
        await self.node.publish(ChangeKind.TENANT, tenant_id)

    async def changed(self, kind: ChangeKind, tenant_id: str, name: str = "") -> None:
        """After a deploy, a delete, a kernel upload or a key revocation made here (the caches of
        this process were updated by the caller): returns once every other front dropped them."""
        await self.node.publish(kind, tenant_id, name)

    def apply_change(self, kind: ChangeKind, tenant_id: str, name: str = "") -> Awaitable[None] | None:
        """An admin change made here or on another front of this node: drop what is cached. A
        flush returns what to await before it counts as applied."""
        if kind == ChangeKind.TENANT:
            self.auth_cache.clear()
            self.function_cache.drop_tenant(tenant_id)
        elif kind == ChangeKind.FUNCTION:
            self.function_cache.forget(tenant_id, name)
        elif kind == ChangeKind.KERNELS:
            self.function_cache.drop_kernels(tenant_id)
        elif kind == ChangeKind.KEYS:
            self.auth_cache.clear()
        elif kind == ChangeKind.FLUSH:
            return self.recorder.flush()
        elif kind == ChangeKind.QUEUED and self.queue_runner is not None:
            self.queue_runner.wake()
        elif kind == ChangeKind.CANCEL and self.queue_runner is not None:
            self.queue_runner.stop_local(name)
        return None

    async def flush_records(self) -> None:
        """Before reading invocation records: every front of the node writes what it batched."""
        await self.recorder.flush()
        await self.node.flush_records()

    def queued(self, tenant_id: str) -> None:
        """Async work was submitted here: the front that drains the queue looks now."""
        self.apply_change(ChangeKind.QUEUED, tenant_id)
        self.node.announce(ChangeKind.QUEUED, tenant_id)

    def stop_async(self, tenant_id: str, invocation_id: str) -> bool:
        """Stop a running async invocation at once, wherever on this node it runs."""
        self.node.announce(ChangeKind.CANCEL, tenant_id, invocation_id)
        return self.queue_runner is not None and self.queue_runner.stop_local(invocation_id)
