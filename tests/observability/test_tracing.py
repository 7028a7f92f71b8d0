"""One invocation is one trace: HTTP span -> scheduler.run -> worker.run -> abi.* spans."""

from __future__ import annotations

from pathlib import Path

import httpx
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.main import create_app
from app.observability.tracing import Tracing
from tests.gpu.runner import Buf, rec_buf, rec_f32, rec_i32, request
from tests.helpers import deploy, make_settings, new_tenant


async def test_trace_spans_from_http_through_the_worker(database_url: str, tmp_path: Path, c_guest) -> None:
    exporter = InMemorySpanExporter()
    app = create_app(make_settings(database_url, tmp_path), span_exporter=exporter)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tw.test") as client:
            _, key = await new_tenant(client, gpu_memory_bytes=1 << 20)
            await deploy(client, key, "runner", c_guest("kernel_runner.c"))
            exporter.clear()
            body = request("scale_f32", [Buf(64)], [rec_buf(0), rec_f32(2), rec_i32(16)], [0], repeat=3)
            traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            r = await client.post("/v1/functions/runner/invoke", content=body, headers={**key, "traceparent": traceparent})
            assert r.status_code == 200, r.text

    spans = exporter.get_finished_spans()
    by_name = {s.name: s for s in spans}
    http = next(s for s in spans if s.name.startswith("POST /v1/functions/{name}/invoke") and s.parent is not None and s.kind.name == "SERVER")
    sched, run = by_name["scheduler.run"], by_name["worker.run"]
    trace_ids = {s.context.trace_id for s in spans}
    assert trace_ids == {0x0AF7651916CD43DD8448EB211C80319C}, "every span belongs to the caller's trace"
    assert sched.parent.span_id == http.context.span_id
    assert run.parent.span_id == sched.context.span_id
    assert run.attributes["tensorwasm.status"] == "ok"
    families = {s.name: s for s in spans if s.name.startswith("abi.")}
    assert {"abi.buffers", "abi.modules", "abi.launch", "abi.synchronize"} <= set(families)
    assert families["abi.launch"].attributes["tensorwasm.abi.calls"] == 3
    for s in families.values():
        assert s.parent.span_id == run.context.span_id
        assert run.start_time <= s.start_time <= s.end_time <= run.end_time


async def test_no_tracing_configured_costs_nothing(client: httpx.AsyncClient, platform) -> None:
    assert platform.tracing.enabled is False
    assert platform.tracing.traceparent() is None


def test_the_supervisors_lease_span_joins_the_fronts_trace(tmp_path: Path) -> None:
    """With several fronts the lease is granted in the supervisor: its span carries the trace
    context the front sent with the lease request."""
    exporter = InMemorySpanExporter()
    tracing = Tracing(make_settings("sqlite://", tmp_path), exporter)
    front = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with tracing.span_in(front, "scheduler.lease", {"tensorwasm.tenant": "acme"}):
        pass
    with tracing.span_in(None, "scheduler.lease", {}):  # no trace context: no span
        pass
    (span,) = exporter.get_finished_spans()
    assert span.name == "scheduler.lease"
    assert span.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert span.parent is not None and span.parent.span_id == 0xB7AD6B7169203331
