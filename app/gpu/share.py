"""GPU time shared by tenant weight, not by context count.

The driver time-slices the contexts of a device round-robin, so a tenant with four busy contexts
would take four fifths of a device from a tenant with one. Each worker (one context, one tenant)
therefore charges its tenant the time its context has work outstanding, and holds back its next
launch while its tenant is above its weighted share of the device's recent time and another
tenant wants the device (docs/architecture.md, "GPU time by tenant").

One file for the node, mapped by the scheduler and every GPU worker, one row per worker (the
scheduler hands out rows and clears a dead worker's row). A row: the tenant's key, the device, the
tenant's `gpu_weight`, the decayed time charged to the row (half-life `HALF_LIFE_S`), whether its
context is busy (or held), when it was last active, until when it wants the device, and its total
(the `tensorwasm_gpu_seconds_total` counter). A worker writes only its own row; a decision reads
the device's rows under one `flock`, once a look without it has found another tenant wanting the
device.

Charging: a busy period starts at the launch that finds the context idle and ends at the
synchronize that drains it. At its start the worker charges what its last period took (so that a
tenant's contexts starting together see each other), and at its end the difference to what it
really took. Time is wall time with work outstanding: it includes the slices the driver gave other
contexts meanwhile, which inflates every tenant alike while they overlap.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.shared_files import flocked, owned_path, sweep_owned

_exp2 = math.exp2

HALF_LIFE_S = 0.5  # the window shares are kept over: several of the longest kernels worth sharing
LINGER_S = 0.02  # a tenant idle for less than this still wants the device (the gap between calls); the default
ALLOWANCE_S = 0.002  # how far above the least-served tenant a tenant may run
CHECK_S = 0.002  # a context that was allowed re-checks at least this often while it launches
POLL_S = 0.001  # a held context looks again this often
MAX_HOLD_S = 1.0  # a hold never lasts longer (a table that never frees it must not stall a call)
STALE_S = 60.0  # a busy row this old is a context that died without its row being cleared
MAX_WEIGHT = 100

_MAGIC = 0x54574753  # "TWGS"
_HEADER = 64
_FIELDS: tuple[tuple[str, type], ...] = (
    ("tenant", np.uint64),
    ("device", np.int32),
    ("busy", np.int32),
    ("weight", np.float64),
    ("usage", np.float64),  # decayed seconds charged, as of `stamp`
    ("stamp", np.float64),
    ("active", np.float64),  # when the row's context last ended a busy period (monotonic s)
    ("since", np.float64),  # when its current busy period started
    ("total", np.float64),  # seconds charged since the row was bound
    ("wants", np.float64),  # until when the row wants its device (busy, held, or lingering)
)
SHARE_FILE = "gpu-share-"  # in the supervisor's run directory (the data directory of a one-process node)


def table_path(directory: Path) -> Path:
    """A node's table file in `directory`, named for this process (app/shared_files.py)."""
    return owned_path(directory, SHARE_FILE)


def sweep_tables(directory: Path) -> None:
    """Remove the tables of nodes that no longer run (killed, so never cleaned)."""
    sweep_owned(directory, SHARE_FILE)


def _size(rows: int) -> int:
    return _HEADER + sum(rows * np.dtype(t).itemsize for _, t in _FIELDS)


def tenant_key(tenant_id: str) -> int:
    """A tenant's row key: never 0 (0 marks a free row)."""
    return int.from_bytes(hashlib.blake2b(tenant_id.encode(), digest_size=8).digest(), "little") | 1


@dataclass(frozen=True)
class Decision:
    allowed: bool
    margin: float  # seconds the tenant may still charge before it must ask again (inf: alone)


class ShareTable:
    """The node's share file. `create` (the scheduler) sizes it; `attach` (a worker) maps it."""

    def __init__(self, path: Path, fd: int, rows: int, linger_s: float = LINGER_S) -> None:
        self.path = path
        self.rows = rows
        self.linger_s = linger_s  # the node's, for every worker alike (kept in the file's header)
        self._fd = fd
        self._map = mmap.mmap(fd, _size(rows))
        at = _HEADER
        self.a: dict[str, np.ndarray] = {}  # whole columns, for a decision
        self.m: dict[str, Any] = {}  # the same as typed memoryviews: one row's field in ~40 ns
        view = memoryview(self._map)
        for name, dtype in _FIELDS:
            size = rows * np.dtype(dtype).itemsize
            self.a[name] = np.ndarray((rows,), dtype=dtype, buffer=self._map, offset=at)
            self.m[name] = view[at : at + size].cast(np.dtype(dtype).char)  # type: ignore[arg-type]
            at += size

    @classmethod
    def create(cls, path: Path, rows: int, linger_s: float = LINGER_S) -> ShareTable:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, _size(rows))
        with mmap.mmap(fd, _HEADER) as m:
            np.ndarray((3,), dtype=np.int64, buffer=m)[:] = (_MAGIC, rows, round(linger_s * 1e9))
        return cls(path, fd, rows, linger_s)

    @classmethod
    def attach(cls, path: Path) -> ShareTable:
        fd = os.open(path, os.O_RDWR)
        with mmap.mmap(fd, _HEADER) as m:
            magic, rows, linger_ns = np.ndarray((3,), dtype=np.int64, buffer=m).tolist()
        if magic != _MAGIC or rows <= 0:
            os.close(fd)
            raise ValueError(f"{path} is not a GPU share table")
        return cls(path, fd, int(rows), linger_ns / 1e9)

    def close(self, unlink: bool = False) -> None:
        for view in self.m.values():
            view.release()
        self.m.clear()
        self.a.clear()
        with contextlib.suppress(BufferError):  # views still held: the mapping goes with the process
            self._map.close()
        os.close(self._fd)
        if unlink:
            with contextlib.suppress(OSError):
                self.path.unlink()

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return flocked(self._fd)

    # -- the scheduler's side -------------------------------------------------------------------
    def clear(self, row: int) -> None:
        with self._locked():
            for arr in self.a.values():
                arr[row] = 0

    def total(self, row: int) -> float:
        return float(self.a["total"][row])

    # -- a worker's side ------------------------------------------------------------------------
    def bind(self, row: int, tenant_id: str, device: int, weight: int) -> None:
        with self._locked():
            for arr in self.a.values():
                arr[row] = 0
            self.a["device"][row] = device
            self.a["weight"][row] = float(min(max(weight, 1), MAX_WEIGHT))
            self.a["tenant"][row] = tenant_key(tenant_id)

    def charge(self, row: int, seconds: float, now: float) -> None:
        """Add `seconds` (negative: a correction) to the row's decayed usage."""
        usage, stamp = self.m["usage"], self.m["stamp"]
        elapsed = now - stamp[row]
        value = (usage[row] * _exp2(-elapsed / HALF_LIFE_S) if elapsed > 0 else usage[row]) + seconds
        usage[row] = value if value > 0 else 0.0
        stamp[row] = now

    def finished(self, row: int, took: float, now: float) -> None:
        """A busy period ended after `took` seconds."""
        m = self.m
        m["total"][row] += took
        m["active"][row] = now
        m["busy"][row] = 0
        m["wants"][row] = now + self.linger_s

    def mark_busy(self, row: int, now: float) -> None:
        """The row's context has launched, or is held back from launching: it wants the device."""
        m = self.m
        if not m["busy"][row]:
            m["since"][row] = now
            m["busy"][row] = 1
            m["wants"][row] = now + STALE_S  # a busy row older than that is a dead context's

    def decide(self, row: int, now: float, upfront: float = 0.0) -> Decision:
        """May this row's context launch now? Yes when no other tenant wants its device, or when
        its tenant's weighted usage is within `ALLOWANCE_S` of the least-served tenant that does;
        when yes, `upfront` is charged in the same step (so the tenant's other contexts see it)."""
        if not self._others_want(row, now):
            # no other tenant wants the device: allowed without the lock or the weighed step
            # (131-204 us a call on a GPU host); the charge is this row's own, which only its
            # worker writes
            if upfront:
                self.charge(row, upfront, now)
            return Decision(True, math.inf)
        with self._locked():
            decision = self._decide(row, now)
            if decision.allowed and upfront:
                self.charge(row, upfront, now)
                return Decision(True, decision.margin - upfront)
            return decision

    def _others_want(self, row: int, now: float) -> bool:
        """Does a row of another tenant want this row's device? Read without the lock: the rows
        that want a device now are few (a tenant's own busy contexts, mostly)."""
        m = self.m
        tenant, device = m["tenant"], m["device"]
        mine, dev = tenant[row], device[row]
        for r in np.flatnonzero(self.a["wants"] > now).tolist():
            if device[r] == dev and tenant[r] != mine and tenant[r] != 0:
                return True
        return False

    def _decide(self, row: int, now: float) -> Decision:
        a = self.a
        mine = a["tenant"][row]
        on = (a["device"] == a["device"][row]) & (a["tenant"] != 0)
        tenants = a["tenant"][on]
        others = (a["wants"][on] > now) & (tenants != mine)
        if not others.any():
            return Decision(True, math.inf)
        usage = a["usage"][on] * np.exp2(-np.maximum(now - a["stamp"][on], 0.0) / HALF_LIFE_S)
        keys, which = np.unique(tenants, return_inverse=True)
        per = np.bincount(which, weights=usage, minlength=len(keys))
        weight = np.ones(len(keys))
        np.maximum.at(weight, which, a["weight"][on])
        norm = per / weight
        wanting = np.zeros(len(keys), dtype=bool)
        wanting[which[others]] = True
        me = int(np.searchsorted(keys, mine))
        margin = (float(norm[wanting].min()) + ALLOWANCE_S - float(norm[me])) * float(weight[me])
        return Decision(margin >= 0, margin)


class ContextShare:
    """One worker's side: `launch` before each launch, `idle` after each synchronize
    (app/gpu/abi.py). `ready` is the step without the wait, for whoever drives its own clock."""

    def __init__(self, table: ShareTable, row: int, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.table = table
        self.row = row
        self._clock = clock
        self._sleep = sleep
        self._since: float | None = None  # the current busy period's start
        self._charged = 0.0  # what this period has charged so far
        self._last = 0.0  # what the last period took: charged up front at the next one's start
        self.next_check = 0.0
        self._margin = 0.0  # what the context may charge before it asks again
        self._held_from: float | None = None
        self.busy = False  # a busy period is open (the launch path reads it, with next_check)
        self.held_s = 0.0  # time this context's launches were held back, all periods

    def launch(self) -> None:
        """Return when the context may launch: at once, or once its tenant is back within its
        share (at most `MAX_HOLD_S` later). A caller may skip it while `busy` and before
        `next_check` (it would return at once)."""
        now = self._clock()
        if self.ready(now):
            return
        held_from = now
        while now - held_from < MAX_HOLD_S:
            self._sleep(POLL_S)
            now = self._clock()
            if self.ready(now):
                return
        self._go(now, self._last if self._since is None else 0.0, math.inf)  # held long enough

    def ready(self, now: float) -> bool:
        """May the context launch now? When not, it is marked held (its tenant wants the device)
        and the caller asks again later."""
        if self._since is None:  # the context was idle: a busy period starts
            upfront = self._last
            if self._held_from is None:
                self.table.mark_busy(self.row, now)
            if now < self.next_check and self._margin >= upfront:
                # allowed a moment ago with room to spare: no need to ask again
                self._go(now, upfront, self._margin)
                return True
            decision = self.table.decide(self.row, now, upfront)
            if decision.allowed:
                self._go(now, 0.0, decision.margin + upfront, charged=upfront)
                return True
        elif now >= self.next_check:
            # a long period with no synchronize: charge what it took beyond its charge, ask again
            extra = now - self._since - self._charged
            if extra > 0:
                self.table.charge(self.row, extra, now)
                self._charged += extra
            decision = self.table.decide(self.row, now)
            if decision.allowed:
                self._go(now, 0.0, decision.margin)
                return True
        else:
            return True
        if self._held_from is None:
            self._held_from = now
            self.table.mark_busy(self.row, now)
        return False

    def _go(self, now: float, charge: float, margin: float, charged: float = 0.0) -> None:
        """Launch from now: `charge` is charged here (`charged` was, by the decision)."""
        if charge:
            self.table.charge(self.row, charge, now)
        if self._since is None:
            self._since = now  # a hold is not busy time: nothing of this context was outstanding
            self.busy = True
            self._charged = charge + charged
        self._margin = margin - charge - charged
        self.next_check = now + CHECK_S
        if self._held_from is not None:
            self.held_s += now - self._held_from
            self._held_from = None

    def idle(self) -> None:
        """The context's work is done (a synchronize returned): settle the period's charge."""
        self.settle(self._clock())

    def settle(self, now: float) -> None:
        if self._since is None:
            return
        took = now - self._since
        self.table.charge(self.row, took - self._charged, now)
        self.table.finished(self.row, took, now)
        self._margin -= max(took - self._charged, 0.0)
        self._last = took
        self._since = None
        self.busy = False
