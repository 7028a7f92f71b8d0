"""Files of shared state that several processes of a node map (the admission table, the GPU share
table): named for the process that made them, so that one whose node was killed is found and
removed at the next start, and stepped under one `flock` (the kernel drops it when its holder
dies, so a killed process never leaves the file locked)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


def owned_path(directory: Path, prefix: str) -> Path:
    """A new file in `directory`: `prefix`, this process's pid and start time, a random tag."""
    from app.worker.lifeline import start_time

    pid = os.getpid()
    return directory / f"{prefix}{pid}.{start_time(pid) or 0}.{secrets.token_hex(4)}"


def sweep_owned(directory: Path, prefix: str) -> None:
    """Remove the files of `owned_path(directory, prefix)` whose process no longer runs."""
    from app.worker.lifeline import start_time

    for path in directory.glob(f"{prefix}*"):
        pid, _, rest = path.name.removeprefix(prefix).partition(".")
        started = rest.split(".", 1)[0]
        if pid.isdigit() and start_time(int(pid)) != started:
            with contextlib.suppress(OSError):
                path.unlink()


@contextlib.contextmanager
def flocked(fd: int) -> Iterator[None]:
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
