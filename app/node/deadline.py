"""A deadline for a block of a call's task: `asyncio.timeout` for the price of one timer.

On the call path a front bounds each exchange with a worker twice: the call's queue wait (a call
still queued at its worker then is refused as late) and its hard deadline. `asyncio.timeout`'s
enter and exit cost 8.4 µs on the 2-core development VM under uvloop (a `Timeout` object, a
timer, a reschedule, the state checks), a `call_later` and its cancel 1.8. `Deadline` does what
those two steps need of it: at its time it cancels the task, unless `check` says not to, and at
its exit it turns that cancellation, and only that one, into TimeoutError. A cancellation from
anywhere else (the client gone, the server stopping) passes through as it came, as with
`asyncio.timeout`, which tells them apart by the task's count of cancellation requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType


class Deadline:
    """`with Deadline(seconds):` around awaits of the running task; TimeoutError out of it when
    the time came first. `check`, if given, is asked when the time comes: False lets the block
    run on (the deadline is then spent). `expired`: the deadline cancelled the task."""

    __slots__ = ("_seconds", "_check", "_task", "_cancelling", "_timer", "expired")

    def __init__(self, seconds: float, check: Callable[[], bool] | None = None) -> None:
        self._seconds = seconds
        self._check = check
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._timer: asyncio.TimerHandle | None = None
        self.expired = False

    def __enter__(self) -> Deadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a Deadline bounds a task's awaits")
        self._task = task
        self._cancelling = task.cancelling()
        self._timer = task.get_loop().call_later(max(0.0, self._seconds), self._fire)
        return self

    def _fire(self) -> None:
        self._timer = None
        if self._task is None or (self._check is not None and not self._check()):
            return
        self.expired = True
        self._task.cancel()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task, self._task = self._task, None
        if not self.expired or task is None:
            return
        # its cancellation withdrawn; TimeoutError only where no other came meanwhile
        if task.uncancel() <= self._cancelling and kind is not None and issubclass(kind, asyncio.CancelledError):
            raise TimeoutError from exc
