"""A streamed invocation: the guest's stdout as it is written, then how it ended.

The response starts once the guest runs on a worker (rate, concurrency, capacity and a missing
function still fail with their status first). A client that goes away cancels the call: the
scheduler kills its worker, and the record says `cancelled`.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime

from app.contract.frames import Payload
from app.contract.messages import Principal
from app.db.ids import new_invocation_id
from app.queue.states import InvocationMode, InvocationStatus
from app.services.invocations import Execution, Executor
from app.services.records import InvocationRecorder

# A large output leaves a front in slices of at most this. The server's send of each waits while
# its transport is paused (past its high-water mark), so a slow client leaves about one slice
# buffered besides the output itself; handed 16 MiB at once, the server keeps what the socket did
# not take (asyncio's transport copies it; a chunked body is first joined with its framing).
SLICE = 256 * 1024


def slices(body: Payload | memoryview) -> Iterator[bytes | memoryview]:
    """`body` as views of at most SLICE bytes; a small bytes object as it is."""
    if isinstance(body, bytes) and len(body) <= SLICE:
        yield body
        return
    view = memoryview(body).cast("B")
    for i in range(0, len(view), SLICE):
        yield view[i : i + SLICE]


_CLEANUPS: set[asyncio.Task[None]] = set()  # keeps cancel-and-record tasks referenced until done


class StreamCall:
    def __init__(
        self, executor: Executor, recorder: InvocationRecorder, tenant: Principal, name: str, version: int | None = None
    ) -> None:
        self.executor = executor
        self.recorder = recorder
        self.tenant = tenant
        self.name = name
        self.version = version  # pinned by the call, else the active one runs
        self.id = new_invocation_id()
        self.result: Execution | None = None
        self.status: InvocationStatus | None = None
        self._chunks: asyncio.Queue[Payload | None] = asyncio.Queue()
        self._started = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._created = datetime.now(UTC)

    async def start(self, body: bytes, query: str, content_type: str, args: list[str] | None = None) -> None:
        """Returns once the guest runs; raises what kept it from running (Rejected, NoCapacity, 404)."""
        self._task = asyncio.get_running_loop().create_task(self._run(body, query, content_type, args))
        started = asyncio.get_running_loop().create_task(self._started.wait())
        try:
            await asyncio.wait({self._task, started}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await self._cancel()
            raise
        finally:
            started.cancel()
        if self._task.done() and not self._started.is_set():
            self._task.result()

    def _on_chunk(self, data: Payload) -> None:
        self._started.set()  # the worker sends an empty chunk as the guest starts
        if data:
            self._chunks.put_nowait(data)

    async def _run(self, body: bytes, query: str, content_type: str, args: list[str] | None) -> None:
        try:
            self.result = await self.executor.execute(
                self.tenant, self.name, self.id, body, query, content_type, on_chunk=self._on_chunk, args=args,
                version=self.version,
            )
            self.status = self.result.status
        finally:
            self._chunks.put_nowait(None)

    async def chunks(self) -> AsyncIterator[bytes | memoryview]:
        """stdout as written; when the consumer stops early (a disconnect), the guest is stopped."""
        try:
            while (chunk := await self._chunks.get()) is not None:
                for piece in slices(chunk):  # a large chunk uncopied, in views
                    yield piece
        finally:
            if self._task is not None and not self._task.done():
                # no await here: a cancelled response scope would cancel it again at once
                cleanup = asyncio.get_running_loop().create_task(self._cancel_and_record())
                _CLEANUPS.add(cleanup)
                cleanup.add_done_callback(_CLEANUPS.discard)
            else:
                self._record()

    async def _cancel_and_record(self) -> None:
        await self._cancel()
        self._record()

    async def _cancel(self) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        self.status = InvocationStatus.CANCELLED

    def _record(self) -> None:
        if self.status is None:  # the run failed unexpectedly (logged by the task)
            self.status = InvocationStatus.INTERNAL_ERROR
        r = self.result
        now = datetime.now(UTC)
        self.recorder.record({
            "id": self.id, "tenant_id": self.tenant.id, "function": self.name, "mode": InvocationMode.STREAM.value,
            "version": r.version if r else None, "status": self.status.value, "created_at": self._created,
            "started_at": r.started_at if r else self._created, "ended_at": now,
            "duration_ms": r.duration_ms if r and self.status != InvocationStatus.CANCELLED else (now - self._created).total_seconds() * 1000,
            "exit_code": r.exit_code if r else None,
            "error": (r.error if r else None) if self.status != InvocationStatus.CANCELLED else "the client disconnected; the guest was stopped",
            "stderr_tail": r.stderr_tail if r else None,
        })

    def end_event(self) -> dict[str, object]:
        r = self.result
        return {
            "invocation_id": self.id,
            "status": (self.status or InvocationStatus.INTERNAL_ERROR).value,
            "exit_code": r.exit_code if r else None,
            "error": r.error if r else None,
        }


async def sse(call: StreamCall) -> AsyncIterator[bytes]:
    """`event: output` per write (UTF-8 text, split only at character boundaries), then one `event: end`."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    async for chunk in call.chunks():
        text = decoder.decode(chunk)
        if text:
            yield _event("output", text)
    tail = decoder.decode(b"", final=True)
    if tail:
        yield _event("output", tail)
    yield _event("end", json.dumps(call.end_event()))


def _event(name: str, text: str) -> bytes:
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return (f"event: {name}\n" + "".join(f"data: {line}\n" for line in lines) + "\n").encode()
