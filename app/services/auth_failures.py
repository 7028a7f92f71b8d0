"""Failed authentications per client address, so guessing keys costs the guesser, not the node.

Each address (an IPv6 address counts by its /64, which one host usually holds whole) has a GCRA
bucket: `rate` failures a second with a burst of `burst`. An address past it is refused before
any lookup until the bucket drains. Per front, in memory, and bounded: the least recently failed
addresses are forgotten first. Callers with a valid key never fail, so they never wait here.
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable

_MAX_ADDRESSES = 65_536


def address_key(host: str | None) -> str:
    """The bucket an address counts against: itself, or its /64 for IPv6."""
    if not host:
        return ""
    if ":" in host:
        try:
            return str(ipaddress.IPv6Network(f"{host}/64", strict=False))
        except ValueError:
            return host
    return host


class AuthFailures:
    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic, max_addresses: int = _MAX_ADDRESSES) -> None:
        self.interval = 1.0 / rate if rate > 0 else 0.0  # 0: no limit
        self.tolerance = (burst - 1) * self.interval
        self.clock = clock
        self.max_addresses = max_addresses
        self._tat: OrderedDict[str, float] = OrderedDict()  # theoretical arrival time per address

    def wait_s(self, address: str) -> float:
        """How long `address` must wait before it may try again; 0 when it may now."""
        if not self.interval:
            return 0.0
        tat = self._tat.get(address)
        if tat is None:
            return 0.0
        late = tat - self.clock() - self.tolerance
        return late if late > 1e-9 else 0.0  # not a float's rounding of a full bucket

    def failed(self, address: str) -> None:
        if not self.interval:
            return
        now = self.clock()
        tat = max(self._tat.pop(address, now), now) + self.interval
        self._tat[address] = tat  # now the most recent
        if len(self._tat) > self.max_addresses:
            self._tat.popitem(last=False)
