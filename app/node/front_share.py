"""A front's time shared between tenants: while a call of a tenant that does not queue is in this
front, the calls that queued at their workers take turns here (docs/architecture.md, "A front's
time between tenants").

A front serves calls in the order their bytes come. A tenant sending more calls than its workers
run keeps every front busy with its own, and a call of another tenant waits behind each loop pass
of them: on a 16-core H200 host, a call at a time beside a flood at 4x its concurrency quota had
3-4x its p99 alone, most of it between its worker's reply and its front taking it up. So a call
admitted behind another at its worker waits for a turn twice, before it is sent and before its
answer, and a call of a tenant with such calls here once more, as it reaches the executor
(before its function is looked up and it is admitted), whenever a *light* tenant (one with calls
here admitted onto a free worker and none queued) other than its own has a call in this front,
or had one within `linger_s`: `per_pass` of the waiting calls go on at each pass of the event
loop, so the light call's next step waits for those, not for every call of the flood. The
linger covers a light tenant's next call from its first step, before it is known to be light.
The calls that wait lose no worker time (their workers have calls queued before them), and
those admitted hold their slots, so the waiting are as bounded as the queue and the front's
connections. With no light tenant here nothing waits, and tenants that all queue never wait on
one another.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque

from app.observability.pending import Held


class FrontShare:
    """Per tenant: its calls in this front admitted onto a free worker (direct) and behind another
    (queued); the tenants with direct calls and none queued (light); the turns of waiting calls."""

    __slots__ = ("_direct", "_queued", "_light", "_lingering", "_waiting", "_draining", "per_pass", "linger_s", "held")

    def __init__(self, per_pass: int, linger_s: float = 0.0) -> None:
        self._direct: dict[str, int] = {}  # tenant id -> its calls here admitted onto a free worker
        self._queued: dict[str, int] = {}  # tenant id -> its calls here admitted behind another
        # tenants with direct calls here and none queued: the ones queued calls give way to (two
        # tenants that both queue give way to neither, so neither loses a pass to the other)
        self._light: set[str] = set()
        # tenants whose last call here left light, until when they still count as light: a light
        # tenant's next call is given way from its first step (its bytes read, its key checked),
        # before it is known to be light again. Ordered by that time (each enters anew, last).
        self._lingering: OrderedDict[str, float] = OrderedDict()
        self._waiting: deque[tuple[str, asyncio.Future[None]]] = deque()  # (tenant id, its turn)
        self._draining = False
        self.per_pass = per_pass  # waiting calls let on at each pass while a light tenant is here or lingers
        self.linger_s = linger_s  # how long a light tenant still counts as here after its last call
        # turns waited for, held until the front publishes its counts (app/observability/pending.py)
        self.held = Held()

    def admitted(self, tenant_id: str, queued: bool) -> None:
        """A call admitted at its worker behind another (`queued`) or onto it free; given back
        with `leave` and the same `queued`."""
        counts = self._queued if queued else self._direct
        counts[tenant_id] = counts.get(tenant_id, 0) + 1
        self._weigh(tenant_id)

    def leave(self, tenant_id: str, queued: bool) -> None:
        counts = self._queued if queued else self._direct
        n = counts[tenant_id] - 1
        if n:
            counts[tenant_id] = n
        else:
            del counts[tenant_id]
        self._weigh(tenant_id)

    def _weigh(self, tenant_id: str) -> None:
        lingering = self._lingering
        if tenant_id in self._queued:
            self._light.discard(tenant_id)
            lingering.pop(tenant_id, None)
        elif tenant_id in self._direct:
            self._light.add(tenant_id)
            lingering.pop(tenant_id, None)
        elif tenant_id in self._light:  # its last call here is over, and it left light
            self._light.discard(tenant_id)
            if self.linger_s > 0:
                now = time.monotonic()
                self._expire(now)  # so the lingering stay those of the last linger_s
                lingering[tenant_id] = now + self.linger_s  # not there while light: it goes last

    def _gives_way(self, tenant_id: str) -> bool:
        """Whether a light tenant other than this one has a call here, or had one within the
        linger."""
        if _another(self._light, tenant_id):
            return True
        if not self._lingering:
            return False
        self._expire(time.monotonic())
        return _another(self._lingering, tenant_id)

    def _expire(self, now: float) -> None:
        lingering = self._lingering
        while lingering and lingering[next(iter(lingering))] <= now:  # the oldest first
            lingering.popitem(last=False)

    def turn(self, tenant_id: str) -> asyncio.Future[None] | None:
        """For a call admitted behind another: a future done at its turn, or None when it goes on
        at once (no light tenant's call here, none lingering)."""
        if not self._gives_way(tenant_id):
            return None
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiting.append((tenant_id, fut))
        self.held.amount += 1
        if not self._draining:
            self._draining = True
            loop.call_soon(self._drain)
        return fut

    def turn_ahead(self, tenant_id: str) -> asyncio.Future[None] | None:
        """For a call not yet looked up nor admitted: a turn as `turn` gives, when its
        tenant has calls here queued at their workers (it likely queues too), else None."""
        if tenant_id not in self._queued:
            return None
        return self.turn(tenant_id)

    def _drain(self) -> None:
        """Runs once per pass of the event loop while calls wait: lets them on in the order they
        came, at most `per_pass` of those that still give way to a light tenant's call."""
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

    @property
    def lingering(self) -> int:
        """Tenants that count as light here for their linger (some maybe past it, until looked at)."""
        return len(self._lingering)

    @property
    def waited(self) -> int:
        """Turns waited for since the front last published its counts."""
        return int(self.held.amount)


def _another(tenants: set[str] | OrderedDict[str, float], tenant_id: str) -> bool:
    """Whether `tenants` holds one other than `tenant_id`."""
    return len(tenants) > 1 or (len(tenants) == 1 and tenant_id not in tenants)
