"""The FastAPI application and its lifespan (the long-lived objects of one api process)."""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy.engine import make_url

from app import __version__
from app.api.errors import install_error_handlers
from app.api.routers import admin, async_invoke, functions, health, invocations, invoke, kernels, usage
from app.db.session import create_engine_for, create_sessionmaker
from app.platform import Platform
from app.runtime.artifacts import ArtifactCache
from app.runtime.compiler import ModuleCompiler
from app.sandbox.client import Sandbox
from app.scheduler.scheduler import Scheduler
from app.services.api_keys import AuthCache
from app.services.cache_refresh import CacheRefresher
from app.queue.runner import QueueRunner
from app.queue.service import AsyncInvocations
from app.services.invocations import Executor, FunctionCache, InvocationRecorder
from app.observability.metrics import Metrics
from app.observability.middleware import ObservabilityMiddleware
from app.observability.tracing import Tracing
from app.settings import Settings, get_settings
from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)


def describe_database(url: str) -> str:
    """The database URL for the log, its password hidden."""
    return make_url(url).render_as_string(hide_password=True)


def announce_admin_token(settings: Settings, token: str) -> None:
    """Show a just-generated admin token once, to a person at a terminal; a log stream (JSON lines
    collected somewhere) only learns where it was saved, never the token itself."""
    path = (settings.data_dir / "admin_token").resolve()
    interactive = sys.stderr.isatty() and settings.log_format != "json"
    if interactive:
        print(f"TensorWasm generated an admin token (also saved in {path}, mode 0600):\n  {token}", file=sys.stderr, flush=True)
    else:
        log.warning("generated an admin token and saved it in %s (mode 0600); read it from there", path)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    settings.ensure_data_dir()
    token, generated = settings.ensure_admin_token()
    if generated:
        announce_admin_token(settings, token)
    engine = create_engine_for(settings.resolved_database_url)
    sessionmaker = create_sessionmaker(engine)
    metrics: Metrics = app.state.metrics
    sandbox = Sandbox(
        settings.compile_memory_bytes,
        settings.compile_timeout_s,
        settings.compile_concurrency,
        on_result=lambda kind, outcome, seconds: metrics.compile(kind.value, outcome.value, seconds),
    )
    compiler = ModuleCompiler(ArtifactCache(settings.cache_dir), sandbox)
    scheduler = Scheduler(settings)
    metrics.attach(scheduler)
    scheduler.on_bind = metrics.cold_start_seconds.observe
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
        metrics=metrics,
        tracing=app.state.tracing,
    )
    platform.executor = Executor(settings, platform.function_cache, scheduler, metrics, app.state.tracing)
    platform.queue = AsyncInvocations(sessionmaker, settings, platform.clock)
    platform.queue_runner = QueueRunner(
        sessionmaker, settings, platform.executor.execute, platform.clock, platform.queue.write_lock
    )
    metrics.attach_queue(platform.queue_runner)
    app.state.platform = platform
    refresher = CacheRefresher(sessionmaker, platform.auth_cache, platform.function_cache, settings.cache_ttl_s, settings.cache_keep_s)
    recorder.start()
    refresher.start()
    await scheduler.start(wait=True)
    devices = sorted({str(w.device.get("name")) for w in scheduler.workers if w.device.get("name")})
    log.info(
        "serving: backend %s, device(s) %s, database %s",
        scheduler.backend, ", ".join(devices) or "none", describe_database(settings.resolved_database_url),
    )
    await platform.queue_runner.start()
    sandbox.start()  # after the workers: the two compete for the cores at start
    try:
        yield
    finally:
        await platform.queue_runner.stop()
        await refresher.stop()
        await sandbox.stop()
        await recorder.stop()
        await scheduler.stop()
        await engine.dispose()
        app.state.tracing.shutdown()


def create_app(settings: Settings | None = None, span_exporter: SpanExporter | None = None) -> FastAPI:
    app = FastAPI(
        title="TensorWasm",
        version=__version__,
        description="Multi-tenant WebAssembly functions over HTTP, with guest-launched CUDA kernels.",
        lifespan=lifespan,
    )
    settings = settings or get_settings()
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.tracing = Tracing(settings, span_exporter)
    install_error_handlers(app)
    # the invoke route right after the health routes: routes are matched in order
    for r in (health.router, invoke.router, admin.router, functions.router, async_invoke.router, invocations.router, kernels.router, usage.router):
        app.include_router(r)
    app.add_middleware(ObservabilityMiddleware, metrics=app.state.metrics, access_log=settings.access_log)
    app.state.tracing.instrument(app)
    return app
