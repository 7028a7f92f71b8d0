"""Who gets the node's next worker slot: per-tenant limits and the fair share of workers.

Pure bookkeeping, no processes and no event loop, so the policy is tested on its own and can move
with the supervisor. A *slot* is the right to hold one worker for one call; the node has
`max_workers` of them. A call asks for a slot with `submit` and holds it until `release`.

Rules (docs/architecture.md, "Fair share of workers"):
- a tenant never runs more than its own `max_concurrency` calls at once;
- a tenant with calls running holds at most `share = max_workers - reserved` slots: the
  `reserved` slots are only for tenants with nothing running, so a quiet tenant's call starts at
  once however hard another tenant floods;
- a freed slot goes to the waiting tenant with the fewest calls running (max-min), ties to the
  one waiting longest; within a tenant, calls are served in arrival order (FIFO).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Blocked(StrEnum):
    """Why a waiting call has no slot (chosen when it gives up waiting)."""

    CONCURRENCY = "concurrency"  # the tenant runs its own max_concurrency calls
    FAIR_SHARE = "fair_share"  # the tenant holds its share of the node's workers
    NO_CAPACITY = "no_capacity"  # every worker slot of the node is held


@dataclass(eq=False)
class Ticket:
    """One call asking for a slot; `granted` turns true when it may take a worker."""

    tenant: str
    seq: int
    granted: bool = False
    waker: Any = None  # the scheduler's handle for the waiting call (app/scheduler/leases.py Waiting)


@dataclass
class _TenantLoad:
    limit: int
    running: int = 0
    queue: deque[Ticket] = field(default_factory=deque)


class FairShare:
    def __init__(self, max_workers: int, reserved: int) -> None:
        self.max_workers = max(1, max_workers)
        # a tenant always gets at least one worker; more reserve than that would idle the node
        self.share = max(1, self.max_workers - max(0, reserved))
        self._load: dict[str, _TenantLoad] = {}
        self._seq = itertools.count()
        self.held = 0  # slots held node-wide

    # -- views ----------------------------------------------------------------------------
    def running(self, tenant: str) -> int:
        load = self._load.get(tenant)
        return load.running if load else 0

    def queue(self, tenant: str) -> deque[Ticket]:
        load = self._load.get(tenant)
        return load.queue if load else deque()

    def queued(self) -> int:
        return sum(len(load.queue) for load in self._load.values())

    def tenants(self) -> Iterator[str]:
        return iter(self._load)

    # -- the rule -------------------------------------------------------------------------
    def _eligible(self, load: _TenantLoad) -> bool:
        return load.running < load.limit and (load.running == 0 or load.running < self.share)

    def blocked(self, tenant: str) -> Blocked:
        load = self._load.get(tenant)
        if load is not None and load.running >= load.limit:
            return Blocked.CONCURRENCY
        if load is not None and load.running >= self.share:
            return Blocked.FAIR_SHARE
        return Blocked.NO_CAPACITY

    def dispatch(self) -> list[Ticket]:
        """Grant free slots to waiting calls; returns the tickets granted now."""
        granted: list[Ticket] = []
        while self.held < self.max_workers:
            best: _TenantLoad | None = None
            for load in self._load.values():
                if load.queue and self._eligible(load):
                    if best is None or (load.running, load.queue[0].seq) < (best.running, best.queue[0].seq):
                        best = load
            if best is None:
                break
            ticket = best.queue.popleft()
            ticket.granted = True
            best.running += 1
            self.held += 1
            granted.append(ticket)
        return granted

    # -- a call's life --------------------------------------------------------------------
    def submit(self, tenant: str, limit: int) -> tuple[Ticket, list[Ticket]]:
        """Queue a call of `tenant` (whose max_concurrency is `limit`); returns its ticket and
        every ticket granted as a result (this one included if it may start at once)."""
        load = self._load.get(tenant)
        if load is None:
            load = self._load[tenant] = _TenantLoad(limit)
        load.limit = max(1, limit)
        ticket = Ticket(tenant, next(self._seq))
        load.queue.append(ticket)
        return ticket, self.dispatch()

    def release(self, ticket: Ticket) -> list[Ticket]:
        """The call that held `ticket`'s slot ended; returns the tickets granted in its place."""
        assert ticket.granted, "release of a ticket that holds no slot"
        ticket.granted = False
        load = self._load[ticket.tenant]
        load.running -= 1
        self.held -= 1
        self._forget_if_quiet(ticket.tenant)
        return self.dispatch()

    def withdraw(self, ticket: Ticket) -> list[Ticket]:
        """The caller gave up (timeout, cancellation): leave the queue, or give the slot back."""
        if ticket.granted:
            return self.release(ticket)
        load = self._load.get(ticket.tenant)
        if load is not None and ticket in load.queue:
            load.queue.remove(ticket)
            self._forget_if_quiet(ticket.tenant)
        return []  # eligibility depends on running calls, not on the queue: nothing changes

    def _forget_if_quiet(self, tenant: str) -> None:
        load = self._load[tenant]
        if load.running == 0 and not load.queue:
            del self._load[tenant]  # bounded by the tenants active now, not by all ever seen
