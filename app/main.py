"""The FastAPI application and its lifespan (the long-lived objects of one api process)."""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app import __version__
from app.api.errors import install_error_handlers
from app.api.routers import admin, functions, health, invocations, invoke, kernels, usage
from app.db.session import create_engine_for, create_sessionmaker
from app.platform import Platform
from app.runtime.artifacts import ArtifactCache
from app.runtime.compiler import ModuleCompiler
from app.node.client import SupervisorClient
from app.node.local import LocalNode
from app.node.port import NodePort
from app.scheduler.scheduler import Scheduler
from app.services.api_keys import AuthCache
from app.services.cache_refresh import CacheRefresher
from app.services.function_cache import FunctionCache
from app.services.records import InvocationRecorder
from app.observability.metrics import Metrics
from app.observability.middleware import ObservabilityMiddleware
from app.observability.tracing import Tracing
from app.settings import Settings, get_settings
from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    settings.ensure_data_dir()
    token, generated = settings.ensure_admin_token()
    if generated:
        print(
            f"TensorWasm generated an admin token (saved in {settings.data_dir / 'admin_token'}):\n  {token}",
            file=sys.stderr,
            flush=True,
        )
    engine = create_engine_for(settings.resolved_database_url)
    sessionmaker = create_sessionmaker(engine)
    compiler = ModuleCompiler(ArtifactCache(settings.cache_dir))
    metrics: Metrics = app.state.metrics
    node_socket: str | None = app.state.node_socket
    scheduler: Scheduler | None = None
    client: SupervisorClient | None = None
    node: NodePort
    if node_socket is None:  # the whole node in this process
        scheduler = Scheduler(settings)
        metrics.attach(scheduler)
        node = LocalNode(scheduler)
    else:  # a front: the scheduler runs in the supervisor
        node = client = SupervisorClient(node_socket)
    recorder = InvocationRecorder(sessionmaker, settings.record_flush_interval_s, settings.record_batch_size)
    platform = Platform(
        settings=settings,
        engine=engine,
        sessionmaker=sessionmaker,
        compiler=compiler,
        auth_cache=AuthCache(settings.cache_ttl_s),
        function_cache=FunctionCache(sessionmaker, compiler, settings.cache_ttl_s, settings.function_cache_size),
        recorder=recorder,
        scheduler=scheduler,
        node=node,
        metrics=metrics,
        tracing=app.state.tracing,
    )
    app.state.platform = platform
    refresher = CacheRefresher(sessionmaker, platform.auth_cache, platform.function_cache, settings.cache_ttl_s, settings.cache_keep_s)
    if client is not None:
        await client.connect(on_change=platform.apply_change)
    recorder.start()
    refresher.start()
    if scheduler is not None:
        await scheduler.start(wait=True)
    try:
        yield
    finally:
        await refresher.stop()
        await recorder.stop()
        if scheduler is not None:
            await scheduler.stop()
        if client is not None:
            await client.close()
        await engine.dispose()
        app.state.tracing.shutdown()


def create_app(settings: Settings | None = None, span_exporter: SpanExporter | None = None, node_socket: str | None = None) -> FastAPI:
    """`node_socket`: run as a front of a node of several, asking the supervisor listening there
    for leases; None: the whole node (scheduler and workers) in this process."""
    app = FastAPI(
        title="TensorWasm",
        version=__version__,
        description="Multi-tenant WebAssembly functions over HTTP, with guest-launched CUDA kernels.",
        lifespan=lifespan,
    )
    settings = settings or get_settings()
    app.state.settings = settings
    app.state.node_socket = node_socket
    app.state.metrics = Metrics(multiprocess=node_socket is not None)
    app.state.tracing = Tracing(settings, span_exporter)
    install_error_handlers(app)
    # the invoke route right after the health routes: routes are matched in order
    for r in (health.router, invoke.router, admin.router, functions.router, invocations.router, kernels.router, usage.router):
        app.include_router(r)
    app.add_middleware(ObservabilityMiddleware, metrics=app.state.metrics, access_log=settings.access_log)
    app.state.tracing.instrument(app)
    return app
