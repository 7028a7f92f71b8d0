"""A front's time shared between tenants: while a call of another tenant is in this front, a
tenant whose calls queue at its workers takes turns here (docs/architecture.md, "A front's time
between tenants").

A front serves calls in the order their bytes come. A tenant sending more calls than its workers
run keeps every front busy with its own, and a call of another tenant waits behind each loop pass
of them: on a 16-core H200 host, a call at a time beside a flood at 4x its concurrency quota had
3-4x its p99 alone, most of it between its worker's reply and its front taking it up. So a call
of a tenant whose last call here queued at its worker waits for a turn twice, before its
admission and before its answer, whenever a call of another tenant that did not queue is in this
front: `per_pass` of the waiting calls go on at each pass of the event loop, so that other call's
next step waits for those, not for every call of the flood. Its tenant loses no worker time: its
workers still have calls queued. With no such call here nothing waits, and a tenant's calls never
wait on its own.
"""

from __future__ import annotations

import asyncio
from collections import deque


class FrontShare:
    """Per tenant: its calls in this front that went straight to a free worker, and whether its
    last call here queued; and the turns of the calls that wait."""

    __slots__ = ("_direct", "_queuing", "_waiting", "_draining", "per_pass", "waited")

    def __init__(self, per_pass: int) -> None:
        self._direct: dict[str, int] = {}  # tenant id -> its calls here admitted onto a free worker
        self._queuing: set[str] = set()  # tenants whose last call here was admitted behind another
        self._waiting: deque[tuple[str, asyncio.Future[None]]] = deque()  # (tenant id, its turn)
        self._draining = False
        self.per_pass = per_pass  # calls let on at each pass while another tenant's call is here
        self.waited = 0  # turns waited for (a metric's count, published with the held counts)

    def admitted(self, tenant_id: str, depth: int) -> bool:
        """A call admitted with `depth` calls queued before it at its worker; True when it counts
        as a direct call (to be given back with `leave`)."""
        if depth:
            self._queuing.add(tenant_id)
            return False
        self._queuing.discard(tenant_id)
        d = self._direct
        d[tenant_id] = d.get(tenant_id, 0) + 1
        return True

    def leave(self, tenant_id: str) -> None:
        d = self._direct
        n = d[tenant_id] - 1
        if n:
            d[tenant_id] = n
        else:
            del d[tenant_id]

    def _gives_way(self, tenant_id: str) -> bool:
        """Whether a direct call of another tenant is here."""
        d = self._direct
        return len(d) > 1 or (len(d) == 1 and tenant_id not in d)

    def turn(self, tenant_id: str) -> asyncio.Future[None] | None:
        """A future done at the call's turn, or None when it goes on at once: its tenant's calls
        do not queue, or no direct call of another tenant is in this front."""
        if tenant_id not in self._queuing or not self._gives_way(tenant_id):
            return None
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiting.append((tenant_id, fut))
        self.waited += 1
        if not self._draining:
            self._draining = True
            loop.call_soon(self._drain)
        return fut

    def _drain(self) -> None:
        """Runs once per pass of the event loop while calls wait: lets them on in the order they
        came, at most `per_pass` of those that still give way to another tenant's call."""
        waiting = self._waiting
        left = self.per_pass
        while waiting:
            tenant_id, fut = waiting[0]
            if not fut.done():  # a cancelled one (its client gone) takes no turn
                if self._gives_way(tenant_id):
                    if not left:
                        break
                    left -= 1
                fut.set_result(None)
            waiting.popleft()
        if waiting:
            # called from a pass's callbacks, call_soon runs it in the next pass
            asyncio.get_running_loop().call_soon(self._drain)
        else:
            self._draining = False

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def forget(self, tenant_id: str) -> None:
        """A tenant with no call here any more (its routes went): no longer queuing."""
        self._queuing.discard(tenant_id)
