"""Turns at SQLite's one write lock for the processes of a node that write in batches.

SQLite lets one connection write at a time; the others wait in its busy handler, which sleeps
1, 2, 5 ... up to 100 ms between tries and so is not fair. On an H200 host, a node of 8 fronts
under wrk (20 s, ~300,000 calls) left 16,000 and 27,000 calls without a record in two runs:
batches failed with "database is locked" after the 5 s lock wait and were kept for the next
try, and a front's last batch failed the same way at shutdown. Taking turns on a kernel file
lock beside the database, a front is woken the moment the last writer lets go: none was lost in
the same runs. PostgreSQL needs no turn."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import AsyncIterator
from pathlib import Path

from sqlalchemy.engine import make_url


class WriteTurn:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600) if path is not None else None

    @classmethod
    def for_url(cls, url: str) -> WriteTurn:
        """The turn of the SQLite database at `url` (a file beside it); none for another database."""
        u = make_url(url)
        if u.get_backend_name() != "sqlite" or not u.database or u.database == ":memory:":
            return cls(None)
        return cls(Path(u.database).with_name(Path(u.database).name + ".write-turn"))

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """This process's turn, waited for in a thread (the loop runs calls meanwhile). One
        process holds a turn at a time: its callers share the file, so they take turns among
        themselves otherwise (the recorder writes one batch at a time)."""
        fd = self._fd
        if fd is None:
            yield
            return
        taking = asyncio.get_running_loop().run_in_executor(None, fcntl.flock, fd, fcntl.LOCK_EX)
        try:
            await asyncio.shield(taking)
        except asyncio.CancelledError:
            # the thread may still get the turn after this: give it back then, or no process
            # of the node would ever write again
            def give_back(done: asyncio.Future[None]) -> None:
                if not done.cancelled() and done.exception() is None:
                    fcntl.flock(fd, fcntl.LOCK_UN)

            taking.add_done_callback(give_back)
            raise
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
