"""How many bytes of request bodies one tenant may hold in this front at once.

A body is read whole before its call waits for a worker, so without a bound a tenant's many
connections (each allowed `max_request_bytes`) could fill the front's memory while they wait,
and every tenant served by that front would pay. The bound is per front: no round trip to the
supervisor on the hot path.
"""

from __future__ import annotations

from app.contract.errors import Rejected, RejectReason


class BodyBudget:
    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self._held: dict[str, int] = {}

    def held(self, tenant_id: str) -> int:
        return self._held.get(tenant_id, 0)

    def hold(self, tenant_id: str) -> BodyHold:
        return BodyHold(self, tenant_id)

    def _take(self, tenant_id: str, n: int) -> None:
        held = self._held.get(tenant_id, 0)
        # a tenant holding nothing may always send one body of the size its route allows
        if held and held + n > self.limit:
            raise Rejected(
                RejectReason.BODY_BYTES,
                f"this tenant's requests in flight hold {held} bytes of bodies; "
                f"{n} more would pass the limit of {self.limit} bytes",
                1,
            )
        self._held[tenant_id] = held + n

    def _give(self, tenant_id: str, n: int) -> None:
        left = self._held.get(tenant_id, 0) - n
        if left > 0:
            self._held[tenant_id] = left
        else:
            self._held.pop(tenant_id, None)


class BodyHold:
    """The bytes one request holds, grown as its body arrives; given back on exit."""

    def __init__(self, budget: BodyBudget, tenant_id: str) -> None:
        self.budget = budget
        self.tenant_id = tenant_id
        self.bytes = 0

    def grow(self, n: int) -> None:
        self.budget._take(self.tenant_id, n)
        self.bytes += n

    def __enter__(self) -> BodyHold:
        return self

    def __exit__(self, *_: object) -> None:
        self.budget._give(self.tenant_id, self.bytes)
        self.bytes = 0
