"""Where a call takes its front's turns in the executor (app/services/invocations.py, Executor._call;
app/node/front_share.py): after its lease and before it is sent, and after its release before
it answers; a run that ended stands even if its caller goes away during the second turn."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from app.contract.messages import Outcome, Run, RunStatus
from app.observability.metrics import Metrics
from app.scheduler.leases import KernelSet
from app.services.invocations import Executor
from tests.helpers import principal
from tests.services.helpers import EchoLease


@dataclass
class _Node:
    """Gives every call a turn to wait for, each a future the test ends."""

    events: list[str] = field(default_factory=list)
    turns: list[asyncio.Future[None]] = field(default_factory=list)

    async def lease(self, *_: Any, **__: Any) -> EchoLease:
        self.events.append("lease")
        return EchoLease(self.events)

    def release(self, lease: EchoLease, outcome: Outcome, kernels_version: str) -> None:
        self.events.append(f"release {outcome.value}")

    def turn(self, lease: EchoLease) -> asyncio.Future[None]:
        self.events.append("turn")
        fut = asyncio.get_running_loop().create_future()
        self.turns.append(fut)
        return fut


def _run() -> Run:
    return Run(invocation_id="inv", function="f", sha256="x", env={}, timeout_ms=1000, wasm_memory_bytes=1 << 20,
               stdout_limit=1 << 20, stderr_limit=1024)


async def _until_turns(node: _Node, n: int) -> None:
    while len(node.turns) < n:
        await asyncio.sleep(0)


def _executor(node: _Node) -> Executor:
    return Executor(None, None, node, Metrics(), None)  # type: ignore[arg-type]  # _call uses the node and metrics only


async def test_a_call_waits_for_a_turn_before_it_is_sent_and_before_it_answers() -> None:
    node = _Node()
    call = asyncio.create_task(_executor(node)._call(principal(), _run(), b"in", 5.0, KernelSet.of({}), None))
    await _until_turns(node, 1)
    assert node.events == ["lease", "turn"]  # leased, not sent
    node.turns[0].set_result(None)
    await _until_turns(node, 2)
    assert node.events == ["lease", "turn", "exchange", f"release {Outcome.OK.value}", "turn"]  # released, not answered
    assert not call.done()
    node.turns[1].set_result(None)
    reply, out = await asyncio.wait_for(call, 5)
    assert reply.status == RunStatus.OK and bytes(out) == b"in"


async def test_a_caller_gone_at_the_first_turn_gives_its_slot_back_unused() -> None:
    node = _Node()
    call = asyncio.create_task(_executor(node)._call(principal(), _run(), b"in", 5.0, KernelSet.of({}), None))
    await _until_turns(node, 1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert node.events == ["lease", "turn", f"release {Outcome.UNUSED.value}"]  # never sent


async def test_a_run_that_ended_stands_if_its_caller_goes_during_the_second_turn() -> None:
    node = _Node()
    call = asyncio.create_task(_executor(node)._call(principal(), _run(), b"in", 5.0, KernelSet.of({}), None))
    await _until_turns(node, 1)
    node.turns[0].set_result(None)
    await _until_turns(node, 2)
    call.cancel()  # its client went away while the answer waited for its turn
    reply, out = await asyncio.wait_for(call, 5)
    assert reply.status == RunStatus.OK and bytes(out) == b"in"
    assert node.events[-2:] == [f"release {Outcome.OK.value}", "turn"]
