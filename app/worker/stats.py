"""A small shared page per worker that the api process reads without asking the worker.

A busy worker is inside a guest, so it cannot answer a request; the page lets /v1/admin/workers
and the metrics show its live GPU bytes and counters at any moment.

Pages are created 0600 and removed when their worker is closed. Each page's name carries the
pid and start time of the process that owns it, so a node starting after a crash removes the
pages of owners that no longer run (`sweep_stale_pages`) and leaves those of live nodes alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import re
import struct
from pathlib import Path

from app.worker.lifeline import start_time

log = logging.getLogger(__name__)

# running / last_done: the mark (`run_mark`) of the invocation the worker runs now / ran last,
# so that a front whose worker died knows whether its call had started (else it is sent again);
# last_used_ms: CLOCK_MONOTONIC at the end of its last run (fronts send calls without the
# supervisor, which reads when a worker was last busy here)
# running_since_ms: CLOCK_MONOTONIC at the start of the running call (the supervisor's backstop
# for a hard deadline that no front enforces: a front stopped mid-call)
# deferred_used: 1 once a call used what the backend's deferred set-up makes (the supervisor
# asks the tenant's next workers to make it ahead, app/contract/messages.py `Bind.warm`)
FIELDS = (
    "gpu_bytes_in_use", "gpu_bytes_cap", "launches", "invocations", "running", "last_done", "last_used_ms", "running_since_ms",
    "deferred_used",
)
_LAYOUT = struct.Struct("<" + "q" * len(FIELDS))
_OFFSET = {name: 8 * i for i, name in enumerate(FIELDS)}  # a field's place, found in one step
_FIELD = struct.Struct("<q")
_PREFIX = "tensorwasm-worker-"
_NAME = re.compile(re.escape(_PREFIX) + r"(\d+)\.(\d+)-([0-9a-f]+)\.stats")


def run_mark(invocation_id: str) -> int:
    """A call's mark on the page: the same in every process (unlike hash()), never 0."""
    return int.from_bytes(hashlib.blake2b(invocation_id.encode(), digest_size=7).digest(), "little") | 1


def stats_dir(data_dir: Path) -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else data_dir
    return base


def page_path(base: Path, worker_id: str) -> Path:
    """Where this process puts the page of worker `worker_id`."""
    pid = os.getpid()
    return base / f"{_PREFIX}{pid}.{start_time(pid) or 0}-{worker_id}.stats"


def sweep_stale_pages(base: Path) -> int:
    """Remove pages whose owning process no longer runs; returns how many."""
    removed = 0
    with contextlib.suppress(OSError):
        for path in base.iterdir():
            m = _NAME.fullmatch(path.name)
            if m is None or start_time(int(m.group(1))) == m.group(2):
                continue
            with contextlib.suppress(OSError):  # another user's, or removed meanwhile
                path.unlink()
                removed += 1
    if removed:
        log.info("removed %d stats pages left by nodes that no longer run", removed)
    return removed


class StatsPage:
    def __init__(self, path: Path, create: bool) -> None:
        self.path = path
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(b"\0" * _LAYOUT.size)
        self._f = open(path, "r+b")
        self._map = mmap.mmap(self._f.fileno(), _LAYOUT.size)

    def get(self, field: str) -> int:
        return int(_FIELD.unpack_from(self._map, _OFFSET[field])[0])

    def read(self) -> dict[str, int]:
        return dict(zip(FIELDS, _LAYOUT.unpack_from(self._map, 0), strict=True))

    def set(self, field: str, value: int) -> None:
        _FIELD.pack_into(self._map, _OFFSET[field], value)

    def close(self, unlink: bool = False) -> None:
        try:
            self._map.close()
            self._f.close()
        finally:
            if unlink:
                self.path.unlink(missing_ok=True)
