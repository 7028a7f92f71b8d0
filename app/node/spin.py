"""Polling for a moment instead of sleeping, in a front and a worker, while a core is free.

At low load every call crosses processes that sleep between messages: the front waits in the
kernel for the worker's reply and, after answering, for its client's next request; the worker
waits for its next call. Waking a sleeping process costs tens of µs on a virtual machine (most
of the guest floor's hop). So for `seconds` after each message a process polls its sockets
instead, yielding its core at every poll, and only while the host has a core to spare:

- a stretch starts only while fewer processes are runnable than the process has cores (read from
  /proc/loadavg at most every millisecond): a polling process never lets its core go idle, and an
  idle core is where the kernel moves waiting work to at once;
- a yield that hands the core to another process (one more involuntary switch) ends the
  stretch; the next message starts another.

So a busy host's cores go to work, not to polling, and an idle process stops polling `seconds`
after its last message.
"""

from __future__ import annotations

import asyncio
import functools
import os
import resource
import time

LOAD_EVERY_S = 0.001
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_WHO = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)  # the thread's own where the system counts it


def _switches() -> int:
    """This thread's involuntary context switches so far."""
    return resource.getrusage(_WHO).ru_nivcsw


class _Load:
    """Whether every core has a runnable process: /proc/loadavg's running count (this process
    included), read with one pread on a descriptor kept open (~1.3 µs)."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/loadavg", os.O_RDONLY)
        except OSError:
            self._fd = None  # no procfs: the yields alone judge

    def full(self) -> bool:
        if self._fd is None:
            return False
        try:
            running = int(os.pread(self._fd, 128, 0).split()[3].split(b"/")[0])
        except (OSError, ValueError, IndexError):
            return False
        return running >= _CORES


@functools.cache  # opened in the process that polls, not in the fork server that imported this
def _load() -> _Load:
    return _Load()


def _host_full() -> bool:
    return _load().full()


class Spin:
    """When to poll rather than sleep: `start` after each message, `keep` at each poll that
    found nothing."""

    __slots__ = ("_full", "_load_at", "_switched", "_until", "seconds")

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds
        self._until = 0.0
        self._switched = 0
        self._load_at = -1.0
        self._full = False

    def start(self, now: float) -> bool:
        """Poll from `now` for `seconds`, unless the host has no core to spare; whether it will."""
        if self.seconds <= 0:
            return False
        if now - self._load_at >= LOAD_EVERY_S:
            self._load_at, self._full = now, _host_full()
        if self._full:
            self._until = 0.0
            return False
        if now >= self._until:  # a new stretch: the switches count from here
            self._switched = _switches()
        self._until = now + self.seconds
        return True

    def keep(self, now: float) -> bool:
        """Whether to poll again: within the stretch, and the yield kept the core."""
        if now >= self._until:
            return False
        os.sched_yield()
        switched = _switches()
        if switched != self._switched:
            self._until = 0.0
            return False
        return True


class Awake:
    """A `Spin` for an event loop: while it polls, a callback is ready every turn, so the loop
    checks its sockets without sleeping."""

    __slots__ = ("_loop", "_ticking", "spin")

    def __init__(self, seconds: float = 0.0) -> None:
        self.spin = Spin(seconds)
        self._ticking = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def poke(self) -> None:
        """A message sent: keep the running loop polling for the reply or the next request."""
        if not self.spin.start(time.monotonic()) or self._ticking:
            return
        self._ticking = True
        self._loop = asyncio.get_running_loop()
        self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        if self._loop is not None and self.spin.keep(time.monotonic()):
            self._loop.call_soon(self._tick)
        else:
            self._ticking = False


AWAKE = Awake()  # the front's one loop; its seconds set at the front's start
