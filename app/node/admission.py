"""The node's shared admission state: one file in shared memory that every front maps, so a warm
call is admitted in one short step without asking another process.

Per tenant (a hash table keyed by the tenant id's digest): the rate's token bucket and the calls
in flight (sent to a worker and not yet answered, running or queued there). Per worker slot: the
calls queued at it, so a front sends a call to the tenant's worker with the shortest queue. Each
count is also kept per front, so that the calls of a front that died are given back when it is
started again (`reclaim`).

One `flock` on the file guards every step (the kernel drops it when its holder dies, so a
killed front never leaves the node locked), taken with a few tries that keep the GIL before a
wait in the kernel (app/shared_files.py). A step costs ~1-3 µs (docs/architecture.md).

A tenant's entry carries nothing once its bucket is full and nothing is in flight: such entries
are reused in place by the next tenant whose probe passes them, so the table never fills with
tenants long gone.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import mmap
import os
import tempfile
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from app.shared_files import flocked, lock, owned_path, sweep_owned, unlock

_MAGIC = 0x54574144  # "TWAD"
_HEADER = 64
BURST_S = 2.0  # the bucket holds this many seconds of the rate (as app/scheduler/ratelimit.py)


_PREFIX = "tensorwasm-admission-"
ADMISSION_FILE = "admission"  # in the supervisor's run directory: a link to the table


def _shm() -> Path:
    from app.worker.stats import stats_dir

    return stats_dir(Path(tempfile.gettempdir()))


def table_path() -> Path:
    """A new table's file: in shared memory where there is some, named for this process (pid and
    start time) so that `sweep_tables` knows a table whose node is gone."""
    return owned_path(_shm(), _PREFIX)


def sweep_tables() -> None:
    """Remove the tables of nodes that no longer run (killed, so never cleaned)."""
    sweep_owned(_shm(), _PREFIX)


@functools.lru_cache(maxsize=65536)
def tenant_key(tenant_id: str) -> bytes:
    return hashlib.blake2b(tenant_id.encode(), digest_size=16).digest()


class Verdict(Enum):
    OK = 0
    RATE = 1  # the tenant's rate: retry after `retry_after` seconds
    FULL = 2  # the tenant's calls in flight are at its bound
    TABLE_FULL = 3  # no entry free for a new tenant (the table holds `tenants` busy tenants)


class Admitted(NamedTuple):
    """A step's answer. A tuple, not a frozen dataclass: made on every call, where a frozen
    dataclass's field-by-field `object.__setattr__` cost ~1.5 µs on the 2-core VM."""

    verdict: Verdict
    slot: int = -1  # the tenant's entry
    retry_after: float = 0.0
    worker: int = -1  # the worker slot picked (when asked to pick)
    depth: int = 0  # the calls queued at it before this one


@dataclass(frozen=True)
class _Layout:
    fronts: int
    tenants: int
    workers: int

    @property
    def offsets(self) -> dict[str, tuple[int, tuple[int, ...], type]]:
        f, t, w = self.fronts, self.tenants, self.workers
        fields: list[tuple[str, tuple[int, ...], type]] = [
            ("keys", (t, 16), np.uint8),
            ("tokens", (t,), np.float64),
            ("stamp", (t,), np.float64),
            ("full_at", (t,), np.float64),
            ("inflight", (t,), np.int32),
            ("front_inflight", (f, t), np.int32),
            ("queued", (w,), np.int32),
            ("front_queued", (f, w), np.int32),
        ]
        out: dict[str, tuple[int, tuple[int, ...], type]] = {}
        at = _HEADER
        for name, shape, dtype in fields:
            at = (at + 7) & ~7
            out[name] = (at, shape, dtype)
            at += int(np.prod(shape)) * np.dtype(dtype).itemsize
        return out

    @property
    def size(self) -> int:
        at, shape, dtype = list(self.offsets.values())[-1]
        return at + int(np.prod(shape)) * np.dtype(dtype).itemsize


class AdmissionTable:
    """A mapped admission file. `create` (the supervisor) sizes it; `attach` (a front) maps it."""

    def __init__(self, path: Path, fd: int, layout: _Layout) -> None:
        self.path = path
        self._fd = fd
        self.layout = layout
        self._map = mmap.mmap(fd, layout.size)
        arrays = {
            name: np.ndarray(shape, dtype=dtype, buffer=self._map, offset=at) for name, (at, shape, dtype) in layout.offsets.items()
        }
        self._np = arrays  # for the rare whole-table steps (reclaim, clear)
        view = memoryview(self._map)

        def typed(name: str, code: str) -> Any:  # typeshed's memoryview takes ints only
            at, shape, dtype = layout.offsets[name]
            part: Any = view[at : at + int(np.prod(shape)) * np.dtype(dtype).itemsize]
            return part.cast(code)

        # scalar steps through typed memoryviews: ~10x cheaper per element than numpy indexing
        self._keys_at = layout.offsets["keys"][0]
        self._tokens = typed("tokens", "d")
        self._stamp = typed("stamp", "d")
        self._full_at = typed("full_at", "d")
        self._inflight = typed("inflight", "i")
        self._front_inflight = typed("front_inflight", "i")  # [front * tenants + slot]
        self._queued = typed("queued", "i")
        self._front_queued = typed("front_queued", "i")  # [front * workers + worker]
        self._slots: dict[bytes, int] = {}  # this process's memo of where a tenant's entry was

    @classmethod
    def create(cls, path: Path, fronts: int, tenants: int, workers: int) -> AdmissionTable:
        layout = _Layout(fronts, tenants, workers)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, layout.size)
        table = cls(path, fd, layout)
        np.ndarray((4,), dtype=np.int64, buffer=table._map, offset=0)[:] = (_MAGIC, fronts, tenants, workers)
        return table

    @classmethod
    def attach(cls, path: Path) -> AdmissionTable:
        fd = os.open(path, os.O_RDWR)
        head = os.pread(fd, 32, 0)
        magic, fronts, tenants, workers = np.frombuffer(head, dtype=np.int64)
        if magic != _MAGIC:
            os.close(fd)
            raise ValueError(f"{path} is not an admission table")
        return cls(path, fd, _Layout(int(fronts), int(tenants), int(workers)))

    def _key(self, slot: int) -> bytes:
        at = self._keys_at + 16 * slot
        return self._map[at : at + 16]

    def close(self) -> None:
        for v in (self._tokens, self._stamp, self._full_at, self._inflight, self._front_inflight, self._queued, self._front_queued):
            v.release()
        self._np.clear()
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return flocked(self._fd)

    # -- tenants ----------------------------------------------------------------------------------
    def _find(self, key: bytes, now: float, insert: bool) -> int:
        """The tenant's entry (under the lock): found, or made in the first reusable entry on its
        probe path. -1: absent (insert=False) or the table is full."""
        memo = self._slots.get(key)
        if memo is not None and self._key(memo) == key:
            return memo
        n = self.layout.tenants
        start = int.from_bytes(key[:8], "little") % n
        reusable = -1
        for i in range(n):
            slot = (start + i) % n
            held = self._key(slot)
            if held == key:
                self._slots[key] = slot
                return slot
            if not any(held):
                break  # the end of the probe path: the tenant has no entry
            if reusable < 0 and self._inflight[slot] == 0 and self._full_at[slot] <= now:
                reusable = slot
        else:
            slot = -1
        if not insert:
            return -1
        if reusable >= 0:
            slot = reusable
        if slot < 0:
            return -1
        at = self._keys_at + 16 * slot
        self._map[at : at + 16] = key
        self._tokens[slot] = math.inf  # full: set from the rate at the first take
        self._stamp[slot] = now
        self._full_at[slot] = now
        self._inflight[slot] = 0
        if len(self._slots) > 65536:
            self._slots.clear()
        self._slots[key] = slot
        return slot

    def _take_rate(self, slot: int, rate: float, now: float) -> float:
        """One token of the tenant's bucket (0.0), or the seconds until one is there."""
        capacity = max(1.0, rate * BURST_S)
        tokens = min(capacity, self._tokens[slot] + (now - self._stamp[slot]) * rate)
        self._stamp[slot] = now
        if tokens < 1.0:
            self._tokens[slot] = tokens
            return (1.0 - tokens) / rate
        tokens -= 1.0
        self._tokens[slot] = tokens
        self._full_at[slot] = now + (capacity - tokens) / rate
        return 0.0

    def take_rate(self, tenant_id: str, rate: float) -> float:
        """A call of the tenant counted against its rate and nothing else (a name that does not
        exist): 0.0, or the seconds until the rate allows one."""
        now = time.monotonic()
        with self._locked():
            slot = self._find(tenant_key(tenant_id), now, insert=True)
            return 0.0 if slot < 0 else self._take_rate(slot, rate, now)

    def admit(self, front: int, tenant_id: str, rate: float, limit: int, workers: list[int] | None = None) -> Admitted:
        """Admit one call: its rate token, then one of the tenant's `limit` calls in flight; and,
        given the tenant's worker slots, the one with the shortest queue, now one call longer."""
        now = time.monotonic()
        key = tenant_key(tenant_id)
        lock(self._fd)
        try:
            slot = self._find(key, now, insert=True)
            if slot < 0:
                return Admitted(Verdict.TABLE_FULL)
            if self._inflight[slot] >= limit:
                return Admitted(Verdict.FULL, slot)
            wait = self._take_rate(slot, rate, now)
            if wait > 0:
                return Admitted(Verdict.RATE, slot, wait)
            self._inflight[slot] += 1
            self._front_inflight[front * self.layout.tenants + slot] += 1
            if not workers:
                return Admitted(Verdict.OK, slot)
            queued = self._queued
            best = workers[0]
            for w in workers:
                if queued[w] < queued[best]:
                    best = w
            depth = queued[best]
            queued[best] = depth + 1
            self._front_queued[front * self.layout.workers + best] += 1
            return Admitted(Verdict.OK, slot, 0.0, best, depth)
        finally:
            unlock(self._fd)

    def leave(self, front: int, slot: int, worker: int = -1) -> None:
        """An admitted call is over (answered, refused or given up), and off `worker`'s queue."""
        lock(self._fd)
        try:
            at = front * self.layout.tenants + slot
            if self._front_inflight[at] > 0:
                self._front_inflight[at] -= 1
                self._inflight[slot] -= 1
            if worker >= 0:
                at = front * self.layout.workers + worker
                if self._front_queued[at] > 0:
                    self._front_queued[at] -= 1
                    self._queued[worker] -= 1
        finally:
            unlock(self._fd)

    def inflight(self, tenant_id: str) -> int:
        with self._locked():
            slot = self._find(tenant_key(tenant_id), time.monotonic(), insert=False)
            return 0 if slot < 0 else int(self._inflight[slot])

    # -- workers ----------------------------------------------------------------------------------
    def move(self, front: int, worker: int, to: int) -> None:
        """A call taken off `worker`'s queue and put on `to`'s (sent again elsewhere)."""
        lock(self._fd)
        try:
            at = front * self.layout.workers + worker
            if worker >= 0 and self._front_queued[at] > 0:
                self._front_queued[at] -= 1
                self._queued[worker] -= 1
            if to >= 0:
                self._queued[to] += 1
                self._front_queued[front * self.layout.workers + to] += 1
        finally:
            unlock(self._fd)

    def queued(self, worker_slot: int) -> int:
        return int(self._queued[worker_slot])  # one aligned word: read without the lock

    def clear_worker(self, worker_slot: int) -> None:
        """A new worker takes the slot: whatever its predecessor's callers still count is theirs
        to give back, never this worker's."""
        with self._locked():
            self._np["queued"][worker_slot] = 0
            self._np["front_queued"][:, worker_slot] = 0

    # -- a front that died -----------------------------------------------------------------------
    def reclaim(self, front: int) -> int:
        """Give back everything front `front` counted (it died; its calls died with it). Returns
        the calls given back."""
        with self._locked():
            a = self._np
            lost = int(a["front_inflight"][front].sum())
            a["inflight"] -= a["front_inflight"][front]
            a["front_inflight"][front] = 0
            a["queued"] -= a["front_queued"][front]
            np.maximum(a["queued"], 0, out=a["queued"])
            a["front_queued"][front] = 0
            return lost
