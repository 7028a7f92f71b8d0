"""The long-lived objects of one api process (a front, or the whole one-process node), built in
the app lifespan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from app.contract.messages import ChangeKind
from app.db.models import utcnow
from app.runtime.compiler import ModuleCompiler
from app.services.api_keys import AuthCache
from app.settings import Settings

if TYPE_CHECKING:
    from app.observability.metrics import Metrics
    from app.observability.tracing import Tracing
    from app.node.port import NodePort
    from app.scheduler.scheduler import Scheduler
    from app.services.function_cache import FunctionCache
    from app.services.records import InvocationRecorder


@dataclass
class Platform:
    settings: Settings
    engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    compiler: ModuleCompiler
    auth_cache: AuthCache
    function_cache: "FunctionCache"
    recorder: "InvocationRecorder"
    scheduler: "Scheduler | None"  # in-process (one-process node); None in a front
    node: "NodePort"
    metrics: "Metrics"
    tracing: "Tracing"
    clock: Callable[[], datetime] = field(default=utcnow)

    def tenant_changed(self, tenant_id: str) -> None:
        """Drop everything cached about a tenant after an admin change on this node."""
        self.apply_change(ChangeKind.TENANT, tenant_id)
        self.node.announce(ChangeKind.TENANT, tenant_id)

    def changed(self, kind: ChangeKind, tenant_id: str, name: str = "") -> None:
        """After a deploy, a delete, a kernel upload or a key revocation made here (the caches of
        this process were updated by the caller): tell every other front of the node."""
        self.node.announce(kind, tenant_id, name)

    def apply_change(self, kind: ChangeKind, tenant_id: str, name: str = "") -> None:
        """An admin change made here or on another front of this node: drop what is cached."""
        if kind == ChangeKind.TENANT:
            self.auth_cache.clear()
            self.function_cache.drop_tenant(tenant_id)
        elif kind == ChangeKind.FUNCTION:
            self.function_cache.forget(tenant_id, name)
        elif kind == ChangeKind.KERNELS:
            self.function_cache.drop_kernels(tenant_id)
        elif kind == ChangeKind.KEYS:
            self.auth_cache.clear()
