"""Files of shared state that several processes of a node map (the admission table, the GPU share
table): named for the process that made them, so that one whose node was killed is found and
removed at the next start, and stepped under one `flock` (the kernel drops it when its holder
dies, so a killed process never leaves the file locked)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path


def _gil_kept_flock() -> Callable[[int, int], int] | None:
    try:  # PyDLL: the GIL is not let go for the call. Untyped: ints pass as C ints, and
        # declared argument types cost more per call than the system call itself
        return ctypes.PyDLL(None, use_errno=True).flock
    except (OSError, AttributeError):
        return None


# flock(2) steps that cannot wait (a try, the unlock) with this thread's GIL kept: `fcntl.flock`
# lets the GIL go for the call, so a process that got the lock while another of its threads took
# the GIL (a database driver's thread) held it, and every process waiting for it waited, until
# the GIL came back. A wait in the kernel still lets the GIL go: the holder may be another
# thread of this process, which needs the GIL to let go of the lock.
_FLOCK = _gil_kept_flock()
_EX, _UN, _TRY = fcntl.LOCK_EX, fcntl.LOCK_UN, fcntl.LOCK_EX | fcntl.LOCK_NB
# Tries before a wait in the kernel (~0.3 µs each): a step holds the lock for a few µs, and a
# process put to sleep for it is woken only once the holder lets go and a core is free for it,
# tens of µs on a busy host.
LOCK_TRIES = 24


def lock(fd: int) -> None:
    """Take the file's exclusive lock, waiting for it."""
    if _FLOCK is not None:
        for _ in range(LOCK_TRIES):
            if not _FLOCK(fd, _TRY):
                return
            if ctypes.get_errno() not in (errno.EWOULDBLOCK, errno.EINTR):
                raise _call_error()
    fcntl.flock(fd, _EX)


def unlock(fd: int) -> None:
    if _FLOCK is None:
        fcntl.flock(fd, _UN)
    elif _FLOCK(fd, _UN):
        raise _call_error()


def _call_error() -> OSError:
    err = ctypes.get_errno()
    return OSError(err, os.strerror(err))


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
    lock(fd)
    try:
        yield
    finally:
        unlock(fd)
