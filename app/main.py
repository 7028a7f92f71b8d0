"""The FastAPI application and its lifespan (the long-lived objects of one api process)."""

from __future__ import annotations

import importlib.resources
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from opentelemetry.sdk.trace.export import SpanExporter
from starlette.types import ASGIApp

from app import __version__
from app.api.errors import install_error_handlers
from app.api.fastpath import InvokeFastPath
from app.api.gate import AuthGate
from app.api.routers import admin, async_invoke, callbacks, functions, health, invocations, invoke, kernels, logs, secrets, usage
from app.api.routers.invocations import callback_body
from app.db.session import create_engine_for, create_sessionmaker
from app.db.write_turn import WriteTurn
from app.node.local import LocalNode
from app.node.port import NodePort
from app.node.startup import announce_admin_token, freeze_startup_heap, log_serving
from app.node.supervisor_client import SupervisorClient
from app.observability.metrics import Metrics
from app.observability.middleware import ObservabilityMiddleware
from app.observability.stalls import StallWatch
from app.observability.tracing import Tracing
from app.platform import Platform
from app.queue.runner import QueueRunner
from app.queue.service import AsyncInvocations
from app.runtime.artifacts import ArtifactCache
from app.runtime.compiler import ModuleCompiler
from app.sandbox.pool import Sandbox
from app.scheduler.scheduler import Scheduler
from app.services.api_keys import AuthCache
from app.services.auth_failures import AuthFailures
from app.services.body_budget import BodyBudget
from app.services.cache_refresh import CacheRefresher
from app.services.callbacks import CallbackDispatcher, CallbackSecrets
from app.services.function_cache import FunctionCache
from app.services.invocations import Executor
from app.services.logs import Logs, write_async_end
from app.services.records import InvocationRecorder
from app.services.sealing import NodeKey
from app.settings import Settings, get_settings

log = logging.getLogger(__name__)


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
    node_socket: str | None = app.state.node_socket
    scheduler: Scheduler | None = None
    client: SupervisorClient | None = None
    node: NodePort
    if node_socket is None:  # the whole node in this process
        scheduler = Scheduler(settings)
        metrics.attach(scheduler)
        node = LocalNode(scheduler)
    else:  # a front: the scheduler runs in the supervisor
        node = client = SupervisorClient(
            node_socket, settings.queue_limit, settings.queue_wait_ms / 1000, settings.front_share_per_pass,
            settings.front_share_linger_ms / 1000,
        )
        if client.share is not None:
            client.share.held = metrics.pending.count(metrics.front_turns)  # published with the front's held counts
    sandbox = Sandbox(
        settings.compile_memory_bytes,
        settings.compile_timeout_s,
        settings.compile_concurrency,
        on_result=lambda kind, outcome, seconds: metrics.compile(kind.value, outcome.value, seconds),
        limiter=client,  # a front: the supervisor decides who compiles, node-wide
        warm=1 if client is not None else None,  # one ready compile process per front, not per slot
    )
    compiler = ModuleCompiler(ArtifactCache(settings.cache_dir), sandbox)
    turn = WriteTurn.for_url(settings.resolved_database_url)  # the node's writers take turns at SQLite's lock
    recorder = InvocationRecorder(
        sessionmaker, settings.record_flush_interval_s, settings.record_batch_size, settings.log_bytes_per_tenant, turn
    )
    platform = Platform(
        settings=settings,
        engine=engine,
        sessionmaker=sessionmaker,
        compiler=compiler,
        auth_cache=AuthCache(settings.cache_ttl_s),
        function_cache=FunctionCache(
            sessionmaker, compiler, settings.cache_ttl_s, settings.function_cache_size, settings.max_files_entries,
            keys=NodeKey(settings),
        ),
        recorder=recorder,
        scheduler=scheduler,
        node=node,
        metrics=metrics,
        tracing=app.state.tracing,
        bodies=BodyBudget(settings.max_tenant_body_bytes),
        auth_failures=AuthFailures(settings.auth_failures_per_s, settings.auth_failure_burst),
    )
    platform.executor = Executor(settings, platform.function_cache, node, metrics, app.state.tracing)
    platform.queue = AsyncInvocations(sessionmaker, settings, platform.clock, turn)
    platform.logs = Logs(sessionmaker, settings, platform.flush_records)
    platform.callback_secrets = CallbackSecrets(sessionmaker, platform.clock, platform.function_cache.keys_for(settings))
    front: int | None = app.state.front
    if front is None or front == 0:  # one queue runner per node: per-tenant limits hold node-wide
        platform.queue_runner = QueueRunner(
            sessionmaker, settings, platform.executor.execute, platform.clock, platform.queue.write_lock
        )
        metrics.attach_queue(platform.queue_runner)
        platform.callbacks = CallbackDispatcher(
            sessionmaker, settings, platform.clock, metrics, callback_body, platform.callback_secrets, platform.queue.write_lock
        )
        platform.queue_runner.on_finish = lambda session, inv_id, values: write_async_end(session, inv_id, values, settings.log_bytes_per_tenant)
        platform.queue_runner.on_ended = platform.callbacks.wake
    app.state.platform = platform
    refresher = CacheRefresher(sessionmaker, platform.auth_cache, platform.function_cache, settings.cache_ttl_s, settings.cache_keep_s)
    if client is not None:
        await client.connect(on_change=platform.apply_change, front=front or 0)
    recorder.start()
    refresher.start()
    if scheduler is not None:  # the one-process node says what it serves (else the supervisor does)
        await scheduler.start(wait=True)
        log_serving(scheduler, settings)
    if platform.queue_runner is not None:
        await platform.queue_runner.start()
    if platform.callbacks is not None:
        platform.callbacks.start()
    sandbox.start()  # after the workers: the two compete for the cores at start
    if app.state.freeze_heap:
        freeze_startup_heap()
    stalls = StallWatch(metrics.loop_lag, metrics.gc_pause)
    stalls.start()
    metrics.start()  # publishes held counts and phase totals once a second
    try:
        yield
    finally:
        await stalls.stop()
        if platform.queue_runner is not None:
            await platform.queue_runner.stop()
        if platform.callbacks is not None:
            await platform.callbacks.stop()
        await refresher.stop()
        await sandbox.stop()
        await recorder.stop()
        await metrics.stop()  # after the last record batch: its write is counted
        if scheduler is not None:
            await scheduler.stop()
        if client is not None:
            await client.close()
        await engine.dispose()
        turn.close()
        app.state.tracing.shutdown()


DOCS_ASSETS = "/docs/assets"


def install_docs(app: FastAPI) -> None:
    """/docs (Swagger UI) and /redoc, whose scripts, styles and icon the node serves itself from
    the fastapi-offline package's copies: the pages work without internet access."""
    assets = importlib.resources.files("fastapi_offline") / "static"
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(assets)), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"
    redirect_url = app.swagger_ui_oauth2_redirect_url or "/docs/oauth2-redirect"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{openapi_url}",
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=f"{root}{redirect_url}",
            swagger_js_url=f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None},  # no badge fetched from swagger.io
        )

    @app.get(redirect_url, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{DOCS_ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png",
            with_google_fonts=False,
        )


class _App(FastAPI):
    def build_middleware_stack(self) -> ASGIApp:
        # a plain invoke call is served ahead of every layer (app/api/fastpath.py); tracing's
        # instrumentation wants FastAPI's own layer outermost, and every traced call goes
        # through FastAPI anyway
        stack = super().build_middleware_stack()
        return stack if self.state.tracing.enabled else InvokeFastPath(stack, self)


def create_app(
    settings: Settings | None = None, span_exporter: SpanExporter | None = None, node_socket: str | None = None, front: int | None = None,
    freeze_heap: bool = False,
) -> FastAPI:
    """`node_socket`: run as front number `front` of a node of several, asking the supervisor
    listening there for leases; None: the whole node (scheduler and workers) in this process.
    `freeze_heap`: a serving process's (app/node): what startup built leaves the collector's sight."""
    app = _App(
        title="TensorWasm",
        version=__version__,
        description="Multi-tenant WebAssembly functions over HTTP, with guest-launched CUDA kernels.",
        lifespan=lifespan,
        docs_url=None,  # /docs and /redoc below: their assets are served by the node, not a CDN
        redoc_url=None,
        # the app traces and counts through its own providers (app/observability); FastAPI's own
        # would look for global ones on every request (~2.5 us) and double the spans if one is set
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    settings = settings or get_settings()
    app.state.settings = settings
    app.state.node_socket = node_socket
    app.state.front = front
    app.state.freeze_heap = freeze_heap
    app.state.metrics = Metrics(multiprocess=node_socket is not None)
    app.state.tracing = Tracing(settings, span_exporter)
    install_error_handlers(app)
    install_docs(app)
    # the invoke route right after the health routes: routes are matched in order
    for r in (health.router, invoke.router, admin.router, functions.router, async_invoke.router, invocations.router, kernels.router, usage.router,
              secrets.router, logs.router, callbacks.router):
        app.include_router(r)
    app.add_middleware(AuthGate, fastapi=app)  # credentials before any route reads a body
    app.add_middleware(ObservabilityMiddleware, metrics=app.state.metrics, access_log=settings.access_log)
    app.state.tracing.instrument(app)
    return app
