"""A call's counts and record are left to the event loop (app/observability/phases.py, `soon`):
the lease wait is counted while the worker runs the call, the run and the record once the call's
answer is on its way, and none of them is lost."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from app.contract.frames import Payload
from app.contract.messages import Outcome, Result, Run, RunStatus
from app.queue.states import InvocationStatus
from app.scheduler.leases import KernelSet
from app.services.invocations import Execution, Executor, InvokeService
from tests.helpers import principal


@dataclass
class _Events:
    seen: list[str] = field(default_factory=list)
    worker: asyncio.Future[None] | None = None


@dataclass
class _Lease:
    """A worker that runs the call until the test lets it answer."""

    events: _Events
    kernels_version: str = ""
    wait_s: float = 0.0

    async def exchange(self, run: Run, body: bytes, on_chunk: Any = None) -> tuple[Result, bytes]:
        self.events.seen.append("sent")
        self.events.worker = asyncio.get_running_loop().create_future()
        await self.events.worker
        self.events.seen.append("replied")
        return Result(status=RunStatus.OK, stdout_len=len(body), duration_ms=1.0), body


@dataclass
class _Node:
    events: _Events

    async def lease(self, *_: Any, **__: Any) -> _Lease:
        return _Lease(self.events)

    def release(self, lease: _Lease, outcome: Outcome, kernels_version: str) -> None:
        self.events.seen.append("released")

    def turn(self, lease: _Lease) -> None:
        return None


@dataclass
class _Metrics:
    events: _Events

    def waited(self, tenant: str, seconds: float) -> None:
        self.events.seen.append("counted the wait")

    def ran(self, tenant: str, seconds: float) -> None:
        self.events.seen.append("counted the run")


def _run() -> Run:
    return Run(invocation_id="inv", function="f", sha256="x", env={}, timeout_ms=1000, wasm_memory_bytes=1 << 20,
               stdout_limit=1 << 20, stderr_limit=1024)


async def test_the_wait_is_counted_while_the_worker_runs_and_the_run_after_the_call() -> None:
    events = _Events()
    executor = Executor(None, None, _Node(events), _Metrics(events), None)  # type: ignore[arg-type]  # _call uses these two only
    at_return: list[str] = []

    async def call() -> tuple[Result, Payload]:
        got = await executor._call(principal(), _run(), b"in", 5.0, KernelSet.of({}), None)
        at_return.extend(events.seen)  # what had happened when the caller got the reply to answer
        return got

    task = asyncio.create_task(call())
    while events.worker is None:
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert events.seen == ["sent", "counted the wait"]  # done while the call waits for its worker
    events.worker.set_result(None)
    reply, out = await task
    assert reply.status == RunStatus.OK and bytes(out) == b"in"
    assert at_return == ["sent", "counted the wait", "replied", "released"]  # the slot given back before the answer
    assert events.seen == [*at_return, "counted the run"]  # the run counted once the caller could answer


@dataclass
class _Recorder:
    rows: list[dict[str, Any]] = field(default_factory=list)

    def record(self, row: dict[str, Any]) -> None:
        self.rows.append(row)


@dataclass
class _Executor:
    async def execute(self, *_: Any, **__: Any) -> Execution:
        return Execution(InvocationStatus.SUCCEEDED, 3, "text/plain", datetime.now(UTC), 1.5, exit_code=0, stdout=b"out")


async def test_the_record_is_queued_once_the_answer_is_out() -> None:
    recorder = _Recorder()
    service = InvokeService(_Executor(), recorder)  # type: ignore[arg-type]
    tenant = principal()
    outcome = await service.invoke(tenant, "f", b"in", "", "")
    assert outcome.status == 200 and bytes(outcome.body) == b"out"
    assert recorder.rows == []  # the answer goes first
    await asyncio.sleep(0)
    (row,) = recorder.rows
    assert row["id"] == outcome.invocation_id and row["tenant_id"] == tenant.id and row["function"] == "f"
    assert row["status"] == InvocationStatus.SUCCEEDED.value and row["version"] == 3 and row["exit_code"] == 0
