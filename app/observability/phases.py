"""Where a front's CPU goes on the invoke path, phase by phase, always on.

Each phase is timed with `clock()` around a stretch of the front's own code that waits for
nothing, so its time is this process's CPU (with the wall clock: unless the process was preempted
in it, see PhaseClock), and added to this process's totals: plain ints in a list (one event loop
per process: no lock), no metric call per call. `PhaseCounters`
(app/observability/phase_metrics.py) publishes the totals as counters once a second and at each
scrape, and `bench invoke` prints them per call beside the fronts' CPU per call.

What could wait is left out: a cache miss (a database read) is not timed, and neither is the
transfer of a body or response over WHOLE_BYTES. The call path reads the members through the
module names below: `Phase.X` costs ~100 ns on Python 3.11, a module name ~20.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Coroutine, Generator
from enum import IntEnum, StrEnum
from time import perf_counter_ns, thread_time_ns
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class PhaseClock(StrEnum):
    # wall time: a reading costs tens of ns. A front preempted inside a stretch counts the time it
    # did not run: rare with a core to spare, but on a host whose cores are all busy a write that
    # wakes its peer (a run's frame to the worker, an answer to the client) often hands it this core
    WALL = "wall"
    # this thread's CPU time: exact however busy the host, but a reading is a system call
    # (~0.2-1 µs): for profiling (`bench invoke` runs its second node with it), not always on
    CPU = "cpu"


CLOCK = PhaseClock(os.environ.get("TENSORWASM_PHASE_CLOCK", PhaseClock.WALL))  # once per process, at its start
clock = thread_time_ns if CLOCK == PhaseClock.CPU else perf_counter_ns

PUBLISH_S = 1.0  # how often a front publishes its totals (and so how stale another front's may be)

# A body or response this small is read or written whole in practice without waiting: it came
# with the request's head (or the frame's), and a write of it stays under the transport's
# 64 KiB high-water mark. A larger one's transfer can wait on its peer, so it is not timed.
WHOLE_BYTES = 64 * 1024


class Phase(IntEnum):
    AUTH = 0  # the gate's check of a key found in the auth cache
    BODY = 1  # the call's own headers (args, version), its body's budget, reading the body
    WATCH = 2  # the task that cancels the call when its client goes away: made, then cancelled
    LOOKUP = 3  # the function and the tenant's kernels found in the function cache
    ADMIT = 4  # the admission table's step and the worker picked (one process: the scheduler's)
    SEND = 5  # the run message built; its frame encoded and written to the worker
    REPLY = 6  # the worker's reply frame read and decoded once its head is in (not the wait)
    RELEASE = 7  # the lease given back: counts in the table, the connection pooled
    METRICS = 8  # prometheus updates: lease wait, guest run, the call's outcome, the HTTP request
    RECORD = 9  # the call's record built and queued for the next batch
    RESPOND = 10  # the HTTP response built and written
    RECORD_WRITE = 11  # the batched record writes: their steps on the loop and the driver's threads

    @property
    def label(self) -> str:
        return self.name.lower()


AUTH = Phase.AUTH
BODY = Phase.BODY
WATCH = Phase.WATCH
LOOKUP = Phase.LOOKUP
ADMIT = Phase.ADMIT
SEND = Phase.SEND
REPLY = Phase.REPLY
RELEASE = Phase.RELEASE
METRICS = Phase.METRICS
RECORD = Phase.RECORD
RESPOND = Phase.RESPOND
RECORD_WRITE = Phase.RECORD_WRITE

_ns = [0] * len(Phase)
_calls = 0


def lap(phase: Phase, since: int) -> int:
    """Add the time since `since` (a `clock()` reading) to `phase`; returns now, the start of the
    next stretch."""
    now = clock()
    _ns[phase] += now - since
    return now


def answered(since: int) -> int:
    """`lap(RESPOND, since)` for a call whose answer was built: it counts as a call timed."""
    global _calls
    _calls += 1
    return lap(RESPOND, since)


def add_ns(phase: Phase, ns: int) -> None:
    """Time measured otherwise (another thread's CPU)."""
    _ns[phase] += ns


def soon(phase: Phase, fn: Callable[..., object], *args: Any) -> None:
    """`fn(*args)`, timed as `phase`, once the calling task next yields: a call's counts and
    record, which nothing on its path waits for. Asked before a call's run is sent, they are done
    while the worker runs it; asked after its reply, once its answer is written (the fast path
    writes a whole answer before it yields: app/api/fastpath.py)."""
    asyncio.get_running_loop().call_soon(_timed, phase, fn, args)


def _timed(phase: Phase, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
    t = clock()
    try:
        fn(*args)
    finally:
        lap(phase, t)


def totals() -> tuple[tuple[int, ...], int]:
    """Nanoseconds by phase, and calls answered, since this process started."""
    return tuple(_ns), _calls


def steps(phase: Phase, coro: Coroutine[Any, Any, T]) -> Awaitable[T]:
    """`coro`, awaited with the time of each of its steps added to `phase` and none of its waits:
    for work that waits mid-way (a batch write) while the loop runs other calls."""
    return _Steps(phase, coro)


class _Steps(Generic[T]):
    __slots__ = ("phase", "coro")

    def __init__(self, phase: Phase, coro: Coroutine[Any, Any, T]) -> None:
        self.phase = phase
        self.coro = coro

    def __await__(self) -> Generator[Any, Any, T]:
        coro, value, error = self.coro, None, None
        while True:
            t = clock()
            try:
                signal = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as done:
                lap(self.phase, t)
                return done.value
            except BaseException:
                lap(self.phase, t)
                raise
            lap(self.phase, t)
            try:
                value, error = (yield signal), None  # what its task resumes it with
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # a cancellation, thrown in: the coroutine handles it
                value, error = None, exc
