"""Prometheus metrics (`tensorwasm_*`), one registry per app.

In a node of several fronts, each front counts HTTP requests and invocations into the node's
prometheus-client multiprocess directory and the supervisor serves its own families over IPC;
a front's /metrics appends them, so one scrape sees the whole node.

Workers are separate processes, so nothing is counted inside them: each invocation's result
carries the worker's counts (launches, compile cache), which the api process adds up here, and
live gauges (GPU bytes in use) are read at scrape time from each worker's shared stats page.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from app.api.edge import EdgeEvent
from app.contract.messages import HostCounts
from app.observability.pending import Adds, Held, Pending
from app.observability.phase_metrics import PhaseCounters
from app.observability.phases import PUBLISH_S
from app.observability.stalls import stall_histograms
from app.sandbox.errors import CompileOutcome
from app.sandbox.pool import JobKind

if TYPE_CHECKING:
    from app.db.repositories.invocations import Recovered
    from app.queue.runner import QueueRunner
    from app.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
OUTCOMES = ("succeeded", "guest_error", "timeout", "output_limit", "device_error", "worker_crashed", "internal_error")
RESTART_REASONS = (
    "crashed", "exited", "hard_timeout", "device_error", "evicted", "tenant_changed", "quota_changed", "cancelled", "start_failed", "start_refused",
    "fair_share", "rotated", "surplus_spare",
)
WORKER_STATES = ("starting", "spare", "binding", "idle", "busy")
COMPILE_KINDS = tuple(k.value for k in JobKind)
AUTH_OUTCOMES = ("refused", "throttled")  # indexed by "throttled"
COMPILE_OUTCOMES = tuple(o.value for o in CompileOutcome)


class Metrics:
    def __init__(self, multiprocess: bool = False) -> None:
        """`multiprocess`: a front of a node of several; its counts go to the node's
        PROMETHEUS_MULTIPROC_DIR (set before prometheus_client was imported) and `render` reads
        every front's."""
        self.multiprocess = multiprocess
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.invocations = Counter("tensorwasm_invocations", "Invocations by tenant, function and outcome", ["tenant", "function", "outcome"], registry=r)
        # counted where the 429 is answered: a node of several fronts refuses most of them in
        # the fronts (the shared admission table), never asking the supervisor
        self.rejections = Counter("tensorwasm_rejections", "Invocations refused with 429, by tenant and reason", ["tenant", "reason"], registry=r)
        self.invocation_seconds = Histogram(
            "tensorwasm_invocation_duration_seconds", "Invocation latency (api view, queueing included)", ["tenant"], buckets=LATENCY_BUCKETS, registry=r
        )
        # where a call's time went: waiting for its lease (a slot, a worker) and its guest's run;
        # the rest of the duration above is the front's and the transport's
        self.wait_seconds = Histogram(
            "tensorwasm_invocation_wait_seconds", "Invocation time waiting for a lease (a slot and a worker)", ["tenant"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.run_seconds = Histogram(
            "tensorwasm_invocation_run_seconds", "Guest run time, as the worker measured it", ["tenant"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.kernel_launches = Counter("tensorwasm_kernel_launches", "Kernel launches by guests", ["tenant"], registry=r)
        self.compile_cache = Counter("tensorwasm_kernel_compile_cache", "Kernel module loads by compile-cache result", ["result"], registry=r)
        self.http_requests = Counter("tensorwasm_http_requests", "HTTP requests by route template", ["method", "route", "status"], registry=r)
        self.http_seconds = Histogram(
            "tensorwasm_http_request_duration_seconds", "HTTP latency by route template", ["method", "route"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.compiles = Counter(
            "tensorwasm_compiles", "Compiles of tenant code in the sandbox, by kind (wasm, cuda) and outcome", ["kind", "outcome"], registry=r
        )
        self.compile_seconds = Histogram(
            "tensorwasm_compile_duration_seconds", "Sandboxed compile time, waiting for a slot excluded", ["kind"], buckets=LATENCY_BUCKETS, registry=r
        )
        # a front's stalls (its loop's lag, its GC pauses), summed over the fronts; app/observability/stalls.py
        self.loop_lag, self.gc_pause = stall_histograms(r)
        # where a front's own time per call goes (app/observability/phases.py), summed over the fronts
        self.front_phases = PhaseCounters(r)
        # gauges of a node of several fronts: the backlog is the same everywhere, running adds up
        self.async_backlog = Gauge(
            "tensorwasm_async_backlog", "Async invocations queued in the database, not yet started (all nodes)", registry=r, multiprocess_mode="max"
        )
        self.async_running = Gauge("tensorwasm_async_running", "Async invocations this node is running", registry=r, multiprocess_mode="livesum")
        # the cluster as this node sees it. Every series is this node's (Prometheus tells nodes
        # apart by the scrape's `instance`); tensorwasm_node_info maps an instance to its node id.
        # Recoveries are counted by the node that queued the work again, not by the node that died.
        self.node_info = Gauge(
            "tensorwasm_node_info", "1, labelled with this node's id (TENSORWASM_NODE_ID) and host", ["node_id", "host"],
            registry=r, multiprocess_mode="max",
        )
        # only the front running the queue runner sets it; "mostrecent" ignores the other fronts'
        # zeros and a restarted front's stale file
        self.nodes_alive = Gauge(
            "tensorwasm_nodes_alive", "Nodes whose heartbeat is recent (this one included), as this node reads the nodes table",
            registry=r, multiprocess_mode="mostrecent",
        )
        self.async_retries = Counter(
            "tensorwasm_async_retries", "Async invocations this node queued again for another attempt: their node died or stopped", registry=r
        )
        self.async_interrupted = Counter(
            "tensorwasm_async_interrupted", "Async invocations this node ended interrupted: their node died on their last attempt", registry=r
        )
        # what the edge of this front turned away (app/api/edge.py), and failed authentications
        self.edge_closed = Counter(
            "tensorwasm_edge_closed", "Connections the edge refused or closed, by reason (docs/operations.md)", ["reason"], registry=r
        )
        # turns calls waited for in their front (app/node/front_share.py)
        self.front_turns = Counter(
            "tensorwasm_front_turns",
            "Turns calls waited for in their front, up to three a call: their tenant queued at its workers while a light tenant called there",
            registry=r,
        )
        self.auth_failures = Counter(
            "tensorwasm_auth_failures", "Failed authentications: refused (401) or throttled (429, no lookup)", ["outcome"], registry=r
        )
        # callbacks of async invocations, by the outcome of each attempt (app/services/callbacks.py)
        self.callbacks = Counter(
            "tensorwasm_callbacks", "Callback attempts: delivered, retried (failed, tried again later), failed (given up)", ["outcome"], registry=r
        )
        for outcome in ("delivered", "retried", "failed"):
            self.callbacks.labels(outcome)
        for reason in EdgeEvent:
            self.edge_closed.labels(reason.value)
        for outcome in AUTH_OUTCOMES:
            self.auth_failures.labels(outcome)
        for result in ("hit", "miss"):
            self.compile_cache.labels(result)  # present (at 0) before the first GPU module
        for kind in COMPILE_KINDS:
            self.compile_seconds.labels(kind)
            for outcome in COMPILE_OUTCOMES:
                self.compiles.labels(kind, outcome)  # every series exists from the start
        # label children by label values: `labels()` locks and rebuilds its key on every call
        self._children: dict[tuple[object, ...], object] = {}
        # the invoke path's counts, held until the next publication (app/observability/pending.py),
        # and where each is held, found by its label values in one step: a call's six
        # children looked up one by one and held through Pending's dicts cost ~6.2 µs a call on
        # the 2-core VM, these ~1.6
        self.pending = Pending()
        self._tenants: dict[str, _TenantHeld] = {}
        self._outcomes: dict[tuple[str, str, str], Held] = {}
        self._requests: dict[tuple[str, str, int], tuple[Held, Adds]] = {}
        self._publisher: asyncio.Task[None] | None = None

    def child(self, metric: object, *values: str) -> Any:
        key = (id(metric), *values)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*values)  # type: ignore[attr-defined]
        return c

    def rejected(self, tenant: str, reason: str) -> None:
        self.child(self.rejections, tenant, reason).inc()

    def edge_event(self, event: EdgeEvent) -> None:
        self.child(self.edge_closed, event.value).inc()

    def auth_failed(self, throttled: bool) -> None:
        self.child(self.auth_failures, AUTH_OUTCOMES[throttled]).inc()

    def compile(self, kind: str, outcome: str, seconds: float) -> None:
        self.child(self.compiles, kind, outcome).inc()
        self.child(self.compile_seconds, kind).observe(seconds)

    def publish(self) -> None:
        """This process's held counts and phase totals, into their series."""
        self.pending.publish()
        self.front_phases.publish()

    def start(self) -> None:
        self._publisher = asyncio.get_running_loop().create_task(self._publish_loop())

    async def stop(self) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._publisher
        self.publish()

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(PUBLISH_S)
            try:
                self.publish()
            except Exception:  # a metric is never worth a front's shutdown or its later counts
                log.exception("publishing metrics failed")

    def render(self) -> bytes:
        self.publish()  # this front's counts up to now; the others' are at most PUBLISH_S old
        if not self.multiprocess:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry)

    def attach(self, scheduler: Scheduler) -> None:
        """The scheduler runs in this process: its families go in this registry."""
        attach_scheduler(self.registry, scheduler)

    def attach_queue(self, runner: QueueRunner) -> None:
        """The async queue's gauges, set by the runner as they change. The backlog is counted in
        the database with each lease check (every third of `TENSORWASM_QUEUE_LEASE_S`), so it is
        every node's, a few seconds old. The runner's recoveries and its count of live nodes (at
        each heartbeat) too, and this node's id (one runner per node)."""

        def on_counts(backlog: int, running: int) -> None:
            self.async_backlog.set(backlog)
            self.async_running.set(running)

        runner.on_counts = on_counts

        def on_recovered(done: Recovered) -> None:
            self.async_retries.inc(done.requeued)
            self.async_interrupted.inc(done.interrupted)

        runner.on_recovered = on_recovered
        runner.on_nodes = self.nodes_alive.set
        self.node_info.labels(runner.node_id, runner.heartbeat.host).set(1)

    def _tenant(self, tenant: str) -> _TenantHeld:
        held = self._tenants.get(tenant)
        if held is None:
            p = self.pending
            held = self._tenants[tenant] = _TenantHeld(
                p.histogram(self.child(self.wait_seconds, tenant)), p.histogram(self.child(self.run_seconds, tenant)),
                p.histogram(self.child(self.invocation_seconds, tenant)),
            )
        return held

    def waited(self, tenant: str, seconds: float) -> None:
        self._tenant(tenant).wait.add(seconds)

    def ran(self, tenant: str, seconds: float) -> None:
        self._tenant(tenant).run.add(seconds)

    def request(self, method: str, route: str, status: int, seconds: float) -> None:
        """An HTTP request answered (or abandoned), by its route's template."""
        key = (method, route, status)
        held = self._requests.get(key)
        if held is None:
            p = self.pending
            held = self._requests[key] = (
                p.count(self.child(self.http_requests, method, route, str(status))), p.histogram(self.child(self.http_seconds, method, route)),
            )
        held[0].amount += 1.0
        held[1].add(seconds)

    def invocation(self, tenant: str, function: str, outcome: str, seconds: float, host: HostCounts | None) -> None:
        key = (tenant, function, outcome)
        count = self._outcomes.get(key)
        if count is None:
            count = self._outcomes[key] = self.pending.count(self.child(self.invocations, tenant, function, outcome))
        count.amount += 1.0
        self._tenant(tenant).duration.add(seconds)
        if host:
            if host.launches:
                self.pending.inc(self.child(self.kernel_launches, tenant), host.launches)
            if host.compile_hits:
                self.compile_cache.labels("hit").inc(host.compile_hits)
            if host.compile_misses:
                self.compile_cache.labels("miss").inc(host.compile_misses)


class _TenantHeld(NamedTuple):
    """Where a tenant's per-call observations are held."""

    wait: Adds
    run: Adds
    duration: Adds


def attach_scheduler(registry: CollectorRegistry, scheduler: Scheduler) -> None:
    """The scheduler's own families (cold starts, workers, queues, GPU bytes, restarts): in the
    app's registry in a one-process node, in the supervisor's otherwise."""
    cold = Histogram("tensorwasm_cold_start_seconds", "Binding a tenant to a worker (its context) on demand", buckets=LATENCY_BUCKETS, registry=registry)
    scheduler.on_bind = cold.observe
    start = Histogram("tensorwasm_worker_start_seconds", "A worker's start, fork to ready (its context created)", buckets=LATENCY_BUCKETS, registry=registry)
    scheduler.pool.on_start = start.observe
    registry.register(_LiveCollector(scheduler))


class _LiveCollector(Collector):
    """Gauges and scheduler-owned counters, computed at scrape time."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        s = self.scheduler
        states = GaugeMetricFamily("tensorwasm_workers", "Worker processes by state", labels=["state"])
        counts = {st: 0 for st in WORKER_STATES}
        used = GaugeMetricFamily("tensorwasm_gpu_memory_in_use_bytes", "Live GPU buffer bytes per tenant (all its contexts)", labels=["tenant"])
        cap = GaugeMetricFamily("tensorwasm_gpu_memory_cap_bytes", "GPU memory cap per tenant context", labels=["tenant"])
        per_tenant_used: dict[str, int] = {}
        per_tenant_cap: dict[str, int] = {}
        for w in s.workers:
            if w.state in counts:
                counts[w.state] += 1
            if w.tenant_name and w.state != "dead":
                per_tenant_used[w.tenant_name] = per_tenant_used.get(w.tenant_name, 0) + w.live_stats().get("gpu_bytes_in_use", 0)
                per_tenant_cap[w.tenant_name] = w.gpu_cap
        for st, n in counts.items():
            states.add_metric([st], n)
        for t, v in per_tenant_used.items():
            used.add_metric([t], v)
            cap.add_metric([t], per_tenant_cap[t])
        yield states
        yield used
        yield cap

        # per device (label `device`: the node's index of it); a CPU node is one device, budget 0
        committed = GaugeMetricFamily(
            "tensorwasm_gpu_memory_committed_bytes", "Device memory promised to contexts: caps plus per-context overhead", labels=["device"]
        )
        budget = GaugeMetricFamily("tensorwasm_gpu_memory_budget_bytes", "Device memory the scheduler may hand out (0: no GPU)", labels=["device"])
        contexts = GaugeMetricFamily("tensorwasm_device_contexts", "Worker contexts on the device, starting ones included", labels=["device"])
        ceiling = GaugeMetricFamily(
            "tensorwasm_device_context_ceiling", "Contexts the device may hold, configured or learned from a refusal (0: none)", labels=["device"]
        )
        failures = GaugeMetricFamily("tensorwasm_device_start_failures", "Consecutive failed worker starts on the device", labels=["device"])
        backing_off = GaugeMetricFamily("tensorwasm_device_backing_off", "1 while the device waits after failed starts", labels=["device"])
        for d in s.device_views():
            label = [str(d["index"])]
            committed.add_metric(label, d["committed_bytes"])
            budget.add_metric(label, d["budget_bytes"])
            contexts.add_metric(label, d["contexts"])
            ceiling.add_metric(label, d["ceiling"])
            failures.add_metric(label, d["start_failures"])
            backing_off.add_metric(label, 1 if d["status"] == "backing_off" else 0)
        yield from (committed, budget, contexts, ceiling, failures, backing_off)

        queue = GaugeMetricFamily("tensorwasm_queue_depth", "Invocations waiting for a concurrency slot", labels=["tenant"])
        running = GaugeMetricFamily("tensorwasm_running_invocations", "Invocations running now", labels=["tenant"])
        for ts in s.tenants.values():
            queue.add_metric([ts.principal.name], len(ts.waiters))
            running.add_metric([ts.principal.name], ts.running)
        yield queue
        yield running

        gpu = CounterMetricFamily(
            "tensorwasm_gpu_seconds", "GPU time charged to each tenant's contexts on each device (work outstanding, wall time)", labels=["tenant", "device"]
        )
        for (tenant, device), seconds in sorted(s.gpu_time().items()):
            gpu.add_metric([tenant, str(device)], seconds)
        yield gpu

        restarts = CounterMetricFamily("tensorwasm_worker_restarts", "Workers replaced, by reason", labels=["reason"])
        for reason in sorted(set(RESTART_REASONS) | set(s.restarts)):
            restarts.add_metric([reason], s.restarts.get(reason, 0))
        yield restarts
