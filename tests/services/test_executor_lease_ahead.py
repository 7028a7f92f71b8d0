"""A tenant's first call in a front asks for its lease beside its function's read
(app/services/invocations.py, Executor._lease_ahead): the lease is asked before the read ends,
a name that does not exist is still 404 (429 when the lease's admission found the tenant over its
rate) with the lease given back unused, and a caller gone meanwhile leaves no lease held. A tenant
with a worker in the front's routes, a pinned version, a name known missing and a traced call
read first, as before. A call whose tenant queues in its front waits for its turn there
(app/node/front_share.py) before any of it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.contract.errors import Rejected, RejectReason
from app.contract.messages import Outcome, Principal
from app.errors import NotFound
from app.observability.metrics import Metrics
from app.observability.tracing import Tracing
from app.scheduler.leases import KernelSet
from app.services.function_cache import FunctionMeta
from app.services.invocations import Executor
from app.settings import Settings
from tests.helpers import principal
from tests.services.helpers import EchoLease


@dataclass
class _Node:
    """Leases that come when the test says (`grant`), or a refusal (`refuse`)."""

    events: list[str] = field(default_factory=list)
    routed_tenants: set[str] = field(default_factory=set)
    grant: asyncio.Event = field(default_factory=asyncio.Event)
    refuse: Exception | None = None
    released: list[Outcome] = field(default_factory=list)
    ahead: asyncio.Future[None] | None = None  # the turn a call waits for before its read and lease

    def turn_ahead(self, tenant_id: str) -> asyncio.Future[None] | None:
        if self.ahead is not None:
            self.events.append("turn ahead")
        return self.ahead

    def routed(self, tenant_id: str) -> bool:
        return tenant_id in self.routed_tenants

    async def lease(self, principal: Principal, hard_timeout_s: float, traceparent: str | None, check_rate: bool) -> EchoLease:
        self.events.append("lease")
        if self.refuse is not None:  # refused at admission, before any wait
            raise self.refuse
        await self.grant.wait()
        return EchoLease(self.events)

    def release(self, lease: EchoLease, outcome: Outcome, kernels_version: str) -> None:
        self.released.append(outcome)

    def turn(self, lease: EchoLease) -> None:
        return None

    async def check_rate(self, principal: Principal) -> None:
        self.events.append("check_rate")


@dataclass
class _Functions:
    """A function cache whose reads end when the test says (`found`), or find nothing."""

    events: list[str]
    exists: bool = True
    cached_hit: bool = False
    missing_known: bool = False
    found: asyncio.Event = field(default_factory=asyncio.Event)

    def _meta(self) -> tuple[FunctionMeta, KernelSet]:
        return FunctionMeta("f", 1, "x" * 64, {}, "text/plain", None, Path("/nonexistent"), 0.0), KernelSet.of({})

    def cached(self, tenant_id: str, name: str) -> tuple[FunctionMeta, KernelSet] | None:
        return self._meta() if self.cached_hit else None

    def known_missing(self, tenant_id: str, name: str) -> bool:
        return self.missing_known

    async def lookup(self, tenant_id: str, name: str, version: int | None = None) -> tuple[FunctionMeta, KernelSet]:
        self.events.append("read")
        if self.missing_known:
            raise NotFound.of(f"function {name!r}")
        await self.found.wait()
        self.events.append("read done")
        if not self.exists:
            raise NotFound.of(f"function {name!r}")
        return self._meta()


def _executor(node: _Node, functions: _Functions, traced: bool = False) -> Executor:
    settings = Settings()
    tracing = Tracing(settings, InMemorySpanExporter() if traced else None)
    return Executor(settings, functions, node, Metrics(), tracing)  # type: ignore[arg-type]


def _call(ex: Executor, tenant: Principal, version: int | None = None) -> asyncio.Task[Any]:
    return asyncio.create_task(ex.execute(tenant, "f", "inv", b"in", "", "", version=version))


async def _until(check: Any) -> None:
    for _ in range(1000):
        if check():
            return
        await asyncio.sleep(0)
    raise AssertionError("not reached")


async def _call_to_a_missing_name(node: _Node) -> tuple[asyncio.Task[Any], _Functions]:
    """A first call to a name that does not exist: its lease asked, its read not ended yet."""
    fns = _Functions(node.events, exists=False)
    call = _call(_executor(node, fns), principal())
    await _until(lambda: "lease" in node.events)
    return call, fns


async def test_a_first_call_asks_for_its_lease_before_its_function_is_read() -> None:
    node = _Node()
    fns = _Functions(node.events)
    call = _call(_executor(node, fns), principal())
    await _until(lambda: "lease" in node.events and "read" in node.events)
    assert "read done" not in node.events  # the lease is on its way while the read is
    fns.found.set()
    await asyncio.sleep(0.01)
    assert not call.done()  # read, and waiting for its worker
    node.grant.set()
    ex = await asyncio.wait_for(call, 5)
    assert ex.stdout == b"in" and node.events[-1] == "exchange" and node.released == [Outcome.OK]


async def test_a_call_of_a_tenant_that_queues_here_waits_for_its_turn_before_its_read_and_lease() -> None:
    node = _Node(ahead=asyncio.get_running_loop().create_future())
    fns = _Functions(node.events)
    node.grant.set()
    fns.found.set()
    call = _call(_executor(node, fns), principal())
    await _until(lambda: "turn ahead" in node.events)
    await asyncio.sleep(0.01)
    assert node.events == ["turn ahead"] and not call.done()  # nothing read, nothing admitted
    assert node.ahead is not None
    node.ahead.set_result(None)
    ex = await asyncio.wait_for(call, 5)
    assert bytes(ex.stdout) == b"in" and {"read", "lease"} <= set(node.events[1:]) and node.released == [Outcome.OK]


async def test_a_caller_gone_while_it_waits_for_its_turn_ahead_leaves_nothing_held() -> None:
    node = _Node(ahead=asyncio.get_running_loop().create_future())
    call = _call(_executor(node, _Functions(node.events)), principal())
    await _until(lambda: "turn ahead" in node.events)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert node.events == ["turn ahead"] and node.released == []


@pytest.mark.parametrize("case", ["routed", "pinned", "cached", "traced"])
async def test_other_calls_read_first_and_lease_after(case: str) -> None:
    tenant = principal()
    node = _Node(routed_tenants={tenant.id} if case == "routed" else set())
    fns = _Functions(node.events, cached_hit=case == "cached")
    node.grant.set()
    fns.found.set()
    ex = await asyncio.wait_for(_call(_executor(node, fns, traced=case == "traced"), tenant, 3 if case == "pinned" else None), 5)
    assert ex.stdout == b"in"
    expected = ["lease", "exchange"] if case == "cached" else ["read", "read done", "lease", "exchange"]
    assert node.events == expected


async def test_a_missing_name_is_404_once_and_gives_its_lease_back_unused() -> None:
    node = _Node()
    fns = _Functions(node.events, exists=False)
    node.grant.set()
    call = _call(_executor(node, fns), principal())
    await _until(lambda: "lease" in node.events)
    await asyncio.sleep(0.01)  # the lease has come
    fns.found.set()
    with pytest.raises(NotFound):
        await asyncio.wait_for(call, 5)
    assert node.released == [Outcome.UNUSED]
    assert "check_rate" not in node.events  # the lease's admission counted it against the rate


async def test_a_missing_name_while_the_lease_waits_withdraws_it() -> None:
    node = _Node()
    call, fns = await _call_to_a_missing_name(node)
    fns.found.set()
    with pytest.raises(NotFound):
        await asyncio.wait_for(call, 5)
    node.grant.set()  # had it come after all, it would go back unused; withdrawn, it never comes
    await asyncio.sleep(0.01)
    assert node.released == []


@pytest.mark.parametrize(("reason", "raised", "checked"), [(RejectReason.RATE, Rejected, False), (RejectReason.QUEUE_FULL, NotFound, True)])
async def test_a_missing_name_of_a_tenant_over_its_rate_is_429(reason: RejectReason, raised: type[Exception], checked: bool) -> None:
    """Refused for its rate, the lease's admission answers as the rate check would; refused for
    anything else it took no rate token, so the rate is checked (and counted) as before."""
    node = _Node(refuse=Rejected(reason, "no", 1))
    call, fns = await _call_to_a_missing_name(node)
    fns.found.set()
    with pytest.raises(raised):
        await asyncio.wait_for(call, 5)
    assert node.released == []
    assert ("check_rate" in node.events) is checked


async def test_a_read_that_outlasts_the_grant_takes_a_fresh_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    """Granted more than half the grace before the read ended (a compile), the lease's backstop at
    the supervisor could fall inside the run: it goes back unused and the call leases again."""
    node = _Node()
    fns = _Functions(node.events)
    ex = _executor(node, fns)
    monkeypatch.setattr(ex.settings, "hard_timeout_grace_ms", 20)
    node.grant.set()
    call = _call(ex, principal())
    await _until(lambda: "lease" in node.events)
    await asyncio.sleep(0.05)  # granted, and the read goes on past 10 ms
    fns.found.set()
    result = await asyncio.wait_for(call, 5)
    assert result.stdout == b"in"
    assert node.events == ["read", "lease", "read done", "lease", "exchange"]
    assert node.released == [Outcome.UNUSED, Outcome.OK]


async def test_a_name_known_missing_is_read_first_and_counted_against_the_rate() -> None:
    node = _Node()
    fns = _Functions(node.events, missing_known=True)
    with pytest.raises(NotFound):
        await asyncio.wait_for(_call(_executor(node, fns), principal()), 5)
    assert node.events == ["read", "check_rate"]


@pytest.mark.parametrize("lease_came", [False, True])
async def test_a_caller_gone_before_its_lease_is_used_leaves_none_held(lease_came: bool) -> None:
    node = _Node()
    fns = _Functions(node.events)
    call = _call(_executor(node, fns), principal())
    await _until(lambda: "lease" in node.events)
    fns.found.set()
    await _until(lambda: "read done" in node.events)
    if lease_came:
        node.grant.set()
        await asyncio.sleep(0)  # the lease comes while the caller is going
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    node.grant.set()
    await asyncio.sleep(0.01)
    assert node.released == ([Outcome.UNUSED] if lease_came else [])
    assert "exchange" not in node.events
