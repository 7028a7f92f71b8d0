"""The long-lived objects of one api process, built in the app lifespan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from app.db.models import utcnow
from app.runtime.compiler import ModuleCompiler
from app.services.api_keys import AuthCache
from app.settings import Settings

if TYPE_CHECKING:
    from app.observability.metrics import Metrics
    from app.observability.tracing import Tracing
    from app.scheduler.scheduler import Scheduler
    from app.queue.runner import QueueRunner
    from app.queue.service import AsyncInvocations
    from app.services.invocations import Executor, InvocationRecorder, FunctionCache


@dataclass
class Platform:
    settings: Settings
    engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    compiler: ModuleCompiler
    auth_cache: AuthCache
    function_cache: "FunctionCache"
    recorder: "InvocationRecorder"
    scheduler: "Scheduler"
    metrics: "Metrics"
    tracing: "Tracing"
    clock: Callable[[], datetime] = field(default=utcnow)
    executor: "Executor" = field(default=None)  # type: ignore[assignment]  # runs one call (async, stream)
    queue: "AsyncInvocations" = field(default=None)  # type: ignore[assignment]  # submit/cancel/output
    queue_runner: "QueueRunner" = field(default=None)  # type: ignore[assignment]  # drains the queue

    def tenant_changed(self, tenant_id: str) -> None:
        """Drop everything cached about a tenant after an admin change on this node."""
        self.auth_cache.clear()
        self.function_cache.drop_tenant(tenant_id)
        self.scheduler.tenant_changed(tenant_id)
