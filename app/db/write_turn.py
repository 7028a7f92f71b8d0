"""Turns at SQLite's one write lock for the processes of a node that write in batches.

SQLite lets one connection write at a time; the others wait in its busy handler, which sleeps
1, 2, 5 ... up to 100 ms between tries and so is not fair. On an H200 host, a node of 8 fronts
under wrk (20 s, ~300,000 calls) left 16,000 and 27,000 calls without a record in two runs:
batches failed with "database is locked" after the 5 s lock wait and were kept for the next
try, and a front's last batch failed the same way at shutdown. Taking turns on a kernel file
lock beside the database, a front is woken the moment the last writer lets go: in the same
runs no batch failed for want of the lock. The queue's writes (submits, claims, ends, heartbeats, sweeps) and callbacks take
the same turns. PostgreSQL needs no turn."""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path

from sqlalchemy.engine import URL, make_url


class WriteTurn:
    """`async with turn:` a write transaction's turn. On a SQLite file: this process's writers
    one at a time (an asyncio lock), then the node's processes one at a time (the file lock,
    waited for in a thread while the loop runs calls). In-memory SQLite: the process's lock
    alone. PostgreSQL: no turn (row locks; several nodes)."""

    def __init__(self, path: Path | None, local: bool = True) -> None:
        self.path = path
        self._local = asyncio.Lock() if local or path is not None else None
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600) if path is not None else None

    @classmethod
    def for_url(cls, url: str | URL) -> WriteTurn:
        """The turn of the database at `url`: for a SQLite file, a file beside it."""
        u = make_url(url)
        if u.get_backend_name() != "sqlite":
            return cls(None, local=False)
        if not u.database or u.database == ":memory:":
            return cls(None)
        return cls(Path(u.database).with_name(Path(u.database).name + ".write-turn"))

    async def __aenter__(self) -> None:
        if self._local is None:
            return
        await self._local.acquire()
        fd = self._fd
        if fd is None:
            return
        taking = asyncio.get_running_loop().run_in_executor(None, fcntl.flock, fd, fcntl.LOCK_EX)
        try:
            await asyncio.shield(taking)
        except BaseException:
            # the thread may still get the turn after this: give it back then, or no process
            # of the node would ever write again
            def give_back(done: asyncio.Future[None]) -> None:
                if not done.cancelled() and done.exception() is None:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                self._local.release()  # type: ignore[union-attr]  # set above

            taking.add_done_callback(give_back)
            raise

    async def __aexit__(self, *_: object) -> None:
        if self._local is None:
            return
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._local.release()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
