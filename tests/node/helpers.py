"""What the tests of a real node of two fronts share: which front serves a connection, polling,
tenant state and metric samples.

Which front accepts a connection is the kernel's choice; to send a call through one front the
tests stop the other (SIGSTOP) while the connection is made, and use no keep-alive."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.helpers import ADMIN, descendants

FRONT = "app.node.front"
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)


def fronts(supervisor: int) -> list[int]:
    out = []
    for pid in descendants(supervisor):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if FRONT.encode() in cmd:
            out.append(pid)
    return sorted(out)


async def until(check: Callable[[], Awaitable[Any]], what: str, limit_s: float = 60) -> Any:
    """Poll until `check` returns something truthy (a liveness bound, not a measurement)."""
    deadline = time.monotonic() + limit_s
    while True:
        got = await check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@asynccontextmanager
async def http(base: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=NO_KEEPALIVE) as client:
        yield client


@asynccontextmanager
async def only(front: int, others: list[int]) -> AsyncIterator[None]:
    """While inside, new connections can only be accepted by `front`."""
    stopped = [p for p in others if p != front]
    for p in stopped:
        os.kill(p, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in stopped:
            with contextlib.suppress(ProcessLookupError):  # killed inside
                os.kill(p, signal.SIGCONT)
        # a resumed front reads what the supervisor sent it while stopped (changes made through
        # another front) before the next request: a running front gets them within microseconds
        await asyncio.sleep(0.1)


async def written(base: str, key: dict[str, str]) -> None:
    """Every front has written what it batched (invocation records, key uses): listing
    invocations flushes them all. A front stopped inside that write would keep SQLite's write
    lock, and a write through another front would fail once the lock wait ran out."""
    async with http(base) as client:
        r = await client.get("/v1/invocations", headers=key, params={"limit": 1})
        assert r.status_code == 200, r.text


@asynccontextmanager
async def pinned(base: str, front: int, all_fronts: list[int]) -> AsyncIterator[httpx.AsyncClient]:
    """A client whose one kept-alive connection was accepted by `front`: every request it sends
    goes there, while every front runs."""
    keep = httpx.Limits(max_keepalive_connections=1, max_connections=1)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=keep) as client:
        async with only(front, all_fronts):
            assert (await client.get("/healthz")).status_code == 200
        yield client


async def both_fronts(proc: Any) -> list[int]:
    async def two() -> list[int] | None:
        f = fronts(proc.pid)
        return f if len(f) == 2 else None

    return await until(two, "two fronts")  # type: ignore[no-any-return]


async def tenant_busy(client: httpx.AsyncClient, tenant_id: str) -> dict[str, Any] | None:
    r = await client.get("/v1/admin/workers", headers=ADMIN)
    assert r.status_code == 200, r.text
    workers = r.json()
    return next((w for w in workers if w["tenant_id"] == tenant_id and w["state"] == "busy"), None)


def samples(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
