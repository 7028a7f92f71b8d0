"""OpenTelemetry tracing. Spans: the HTTP request (FastAPI instrumentation), scheduling, the
worker's run and the ABI call families inside it.

Workers carry no exporter: the api process sends the W3C `traceparent` with each run, the worker
times its spans and returns them with the result, and they are emitted here with the worker's
ids and timestamps. Nothing is set up (and nothing costs) unless an exporter is configured.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from app import __version__
from app.settings import Settings

_WORKER_SCOPE = InstrumentationScope("tensorwasm.worker", __version__)
_propagator = TraceContextTextMapPropagator()


class Tracing:
    def __init__(self, settings: Settings, exporter: SpanExporter | None = None) -> None:
        self.processors: list[SpanProcessor] = []
        endpoint = settings.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if exporter is not None:
            self.processors.append(SimpleSpanProcessor(exporter))
        elif endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
            self.processors.append(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        self.enabled = bool(self.processors)
        self.resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "tensorwasm"), "service.version": __version__})
        self.provider = TracerProvider(resource=self.resource)
        for p in self.processors:
            self.provider.add_span_processor(p)
        self.tracer = self.provider.get_tracer("tensorwasm", __version__)

    def instrument(self, app: Any) -> None:
        if self.enabled:
            from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

            FastAPIInstrumentor.instrument_app(app, tracer_provider=self.provider, excluded_urls="healthz,readyz,metrics")

    def span(self, name: str, attributes: dict[str, Any]) -> AbstractContextManager[Any]:
        """A current span when tracing, else a no-op context (nothing created on the hot path)."""
        if not self.enabled:
            return nullcontext()
        return self.tracer.start_as_current_span(name, attributes=attributes)

    def span_in(self, traceparent: str | None, name: str, attributes: dict[str, Any]) -> AbstractContextManager[Any]:
        """A span whose parent came from another process (the supervisor's lease span)."""
        if not self.enabled or not traceparent:
            return nullcontext()
        parent = _propagator.extract({"traceparent": traceparent})
        return self.tracer.start_as_current_span(name, context=parent, attributes=attributes)

    def traceparent(self) -> str | None:
        """The current span as a W3C traceparent, for the worker (None when not tracing)."""
        if not self.enabled:
            return None
        carrier: dict[str, str] = {}
        _propagator.inject(carrier)
        return carrier.get("traceparent")

    def emit_worker_spans(self, traceparent: str | None, spans: list[dict[str, Any]]) -> None:
        if not self.enabled or not traceparent or not spans:
            return
        parent_ctx = trace.get_current_span(_propagator.extract({"traceparent": traceparent})).get_span_context()
        trace_id = parent_ctx.trace_id
        for s in spans:
            parent_id = int(s["parent"], 16) if s.get("parent") else parent_ctx.span_id
            span = ReadableSpan(
                name=s["name"],
                context=SpanContext(trace_id, int(s["id"], 16), False, TraceFlags(TraceFlags.SAMPLED)),
                parent=SpanContext(trace_id, parent_id, False, TraceFlags(TraceFlags.SAMPLED)),
                resource=self.resource,
                attributes=s.get("attributes", {}),
                kind=SpanKind.INTERNAL,
                start_time=s["start"],
                end_time=s["end"],
                instrumentation_scope=_WORKER_SCOPE,
            )
            for p in self.processors:
                p.on_end(span)

    def shutdown(self) -> None:
        if self.enabled:
            self.provider.shutdown()

