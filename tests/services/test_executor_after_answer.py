"""Where the HTTP path writes a call's answer at once it asks, through `after_answer`, for the
call's lease back only once the answer is written (app/services/invocations.py): a call that ran
through leaves its release there; any other outcome, a call that waits for a turn before it
answers, and a call with no such path release before the executor returns."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from app.contract.errors import WorkerCrashed
from app.contract.messages import Outcome, Result, Run, RunStatus
from app.observability.metrics import Metrics
from app.scheduler.leases import KernelSet
from app.services.invocations import Executor, after_answer
from tests.helpers import principal
from tests.services.helpers import EchoLease


@dataclass
class _Node:
    events: list[str] = field(default_factory=list)
    lease_kind: type[EchoLease] = EchoLease
    turns: bool = False

    async def lease(self, *_: Any, **__: Any) -> EchoLease:
        return self.lease_kind(self.events)

    def release(self, lease: EchoLease, outcome: Outcome, kernels_version: str) -> None:
        self.events.append(f"release {outcome.value}")

    def turn(self, lease: EchoLease) -> asyncio.Future[None] | None:
        if not self.turns:
            return None
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


def _run() -> Run:
    return Run(invocation_id="inv", function="f", sha256="x", env={}, timeout_ms=1000, wasm_memory_bytes=1 << 20,
               stdout_limit=1 << 20, stderr_limit=1024)


async def _call(node: _Node, later: list[Callable[[], None]] | None) -> tuple[Result, Any]:
    token = after_answer.set(later)
    try:
        executor = Executor(None, None, node, Metrics(), None)  # type: ignore[arg-type]  # _call uses the node and metrics only
        return await executor._call(principal(), _run(), b"in", 5.0, KernelSet.of({}), None)
    finally:
        after_answer.reset(token)


async def test_a_call_that_ran_through_is_released_by_the_path_after_its_answer() -> None:
    node, later = _Node(), []
    reply, out = await _call(node, later)
    assert reply.status == RunStatus.OK and bytes(out) == b"in"
    assert node.events == ["exchange"] and len(later) == 1  # nothing given back yet: the answer goes first
    later[0]()
    assert node.events == ["exchange", f"release {Outcome.OK.value}"]


async def test_without_such_a_path_the_call_is_released_before_it_returns() -> None:
    node = _Node()
    await _call(node, None)
    assert node.events == ["exchange", f"release {Outcome.OK.value}"]


async def test_a_call_that_waits_for_a_turn_before_its_answer_is_released_before_the_wait() -> None:
    node, later = _Node(turns=True), []
    await _call(node, later)
    assert node.events == ["exchange", f"release {Outcome.OK.value}"] and later == []


async def test_a_call_that_failed_is_released_at_once() -> None:
    class Odd(EchoLease):  # a reply that is not a Result: the worker is taken for lost
        async def exchange(self, run: Run, body: bytes, on_chunk: Any = None) -> tuple[Any, bytes]:
            self.events.append("exchange")
            return object(), b""

    node, later = _Node(lease_kind=Odd), []
    with pytest.raises(WorkerCrashed):
        await _call(node, later)
    assert node.events[-1].startswith("release ") and later == []
