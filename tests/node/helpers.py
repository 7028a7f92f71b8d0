"""What the tests of a real node of two fronts share: which front serves a connection, SQLite's
write lock, polling, tenant state and metric samples.

Which front accepts a connection is the kernel's choice; to send a call through one front the
tests stop the other (SIGSTOP) while the connection is made, and use no keep-alive."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.engine import make_url

from app.worker.stats import StatsPage, stats_dir
from tests.helpers import ADMIN, children_of

FRONT = "app.node.front"
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)


def fronts(supervisor: int) -> list[int]:
    """The supervisor's fronts: its own children (a process a front forks bears the front's
    command line until it execs)."""
    out = []
    for pid in children_of(supervisor):
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


async def all_stopped(pids: list[int]) -> bool:
    def state(pid: int) -> str:
        try:  # the state follows the parenthesised command, which may hold spaces
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return "T"  # gone: it runs no more either

    return all(state(p) == "T" for p in pids)


class WriteLock:
    """SQLite's one write lock for the whole database, looked at from outside the node. A running
    process that holds it (a front writing its records, a queue runner renewing leases) lets go
    within ms; a stopped one keeps it."""

    def __init__(self, database_url: str) -> None:
        self.probe = sqlite3.connect(str(make_url(database_url).database), timeout=0, isolation_level=None)

    def held(self) -> bool:
        try:
            self.probe.execute("BEGIN IMMEDIATE")
            self.probe.execute("ROLLBACK")
            return False
        except sqlite3.OperationalError:
            return True

    async def held_throughout(self, seconds: float) -> bool:
        """Held at every look for `seconds`: by a stopped process, not one that happened to write."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if not self.held():
                return False
            await asyncio.sleep(0.02)
        return True

    def close(self) -> None:
        self.probe.close()


@contextmanager
def write_lock(database_url: str) -> Iterator[WriteLock | None]:
    """None on PostgreSQL, which locks rows: a stopped front holds none that another call needs."""
    if make_url(database_url).get_backend_name() != "sqlite":
        yield None
        return
    lock = WriteLock(database_url)
    try:
        yield lock
    finally:
        lock.close()


@asynccontextmanager
async def only(front: int, others: list[int], lock: WriteLock | None = None) -> AsyncIterator[None]:
    """While inside, new connections can only be accepted by `front`. With `lock`, the others are
    stopped outside any write of theirs (they run on and are stopped again until so): a test that
    writes through `front` would otherwise wait out the lock's 5 s and get a 503."""
    stopped = [p for p in others if p != front]

    def resume() -> None:
        for p in stopped:
            with contextlib.suppress(ProcessLookupError):  # killed inside
                os.kill(p, signal.SIGCONT)

    for _ in range(50):
        for p in stopped:
            os.kill(p, signal.SIGSTOP)
        await until(lambda: all_stopped(stopped), "the other fronts to stop", limit_s=5)  # kill() does not wait
        if lock is None or not await lock.held_throughout(0.3):
            break
        resume()
        await asyncio.sleep(0.1)
    else:
        resume()
        raise AssertionError("the stopped fronts were inside a database write at every try")
    try:
        yield
    finally:
        resume()
        # a resumed front reads what the supervisor sent it while stopped (changes made through
        # another front) before the next request: a running front gets them within microseconds
        await asyncio.sleep(0.1)


@asynccontextmanager
async def pinned(base: str, front: int, all_fronts: list[int]) -> AsyncIterator[httpx.AsyncClient]:
    """A client whose one kept-alive connection was accepted by `front`: every request it sends
    goes there, while every front runs."""
    keep = httpx.Limits(max_keepalive_connections=1, max_connections=1)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=keep) as client:
        async with only(front, all_fronts):
            assert (await client.get("/healthz")).status_code == 200
        yield client


async def both_fronts(proc: Any, count: int = 2) -> list[int]:
    """The node's front pids, once all `count` of them run."""

    async def up() -> list[int] | None:
        f = fronts(proc.pid)
        return f if len(f) == count else None

    return await until(up, f"{count} fronts")  # type: ignore[no-any-return]


async def tenant_busy(client: httpx.AsyncClient, tenant_id: str) -> dict[str, Any] | None:
    """A worker of the tenant that runs a call: shown busy, and its stats page marks a run in
    progress. Busy alone is not enough: a front counts a call at its worker before it writes it
    there, so a call sent from another front meanwhile could still reach the worker first."""
    r = await client.get("/v1/admin/workers", headers=ADMIN)
    assert r.status_code == 200, r.text
    workers = r.json()
    busy = next((w for w in workers if w["tenant_id"] == tenant_id and w["state"] == "busy"), None)
    return busy if busy is not None and _runs(busy["id"]) else None


def _runs(worker_id: str) -> bool:
    """The worker's stats page (app/worker/stats.py) marks a run in progress; with no shared
    memory to look in (the page is then in the node's data directory), busy has to do."""
    shm = Path("/dev/shm")
    if stats_dir(shm / "unused") != shm:
        return True
    for path in shm.glob(f"tensorwasm-worker-*-{worker_id}.stats"):
        try:
            page = StatsPage(path, create=False)
        except OSError:  # the worker's page removed meanwhile
            continue
        try:
            return page.get("running") != 0
        finally:
            page.close()
    return False


def samples(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
