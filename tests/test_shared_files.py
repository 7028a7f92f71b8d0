"""The lock of the node's shared files (app/shared_files.py): one holder at a time across
processes, a waiter served once the holder lets go or dies, and a bad descriptor an error."""

from __future__ import annotations

import errno
import mmap
import multiprocessing
import os
import signal
import struct
import threading
import time
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest

from app import shared_files
from app.shared_files import flocked, lock, unlock

_CTX = multiprocessing.get_context("spawn")  # fresh interpreters: the test process has threads
_ROUNDS = 3000


def _bump(path: str, rounds: int, tries: int) -> None:
    shared_files.LOCK_TRIES = tries
    fd = os.open(path, os.O_RDWR)  # a descriptor of its own: flock is per open file
    with mmap.mmap(fd, 8) as m:
        for _ in range(rounds):
            with flocked(fd):
                (n,) = struct.unpack_from("q", m)
                os.sched_yield()  # give the others every chance to step in between read and write
                struct.pack_into("q", m, 0, n + 1)


@pytest.mark.parametrize("tries", [shared_files.LOCK_TRIES, 0])
def test_one_holder_at_a_time_across_processes(tmp_path: Path, tries: int) -> None:
    """With the tries before a wait and without them (every contended step waits in the kernel)."""
    path = tmp_path / "counter"
    path.write_bytes(bytes(8))
    procs = [_CTX.Process(target=_bump, args=(str(path), _ROUNDS, tries)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert struct.unpack("q", path.read_bytes())[0] == 4 * _ROUNDS  # no step lost to another's


def _hold(path: str, ready: Event, seconds: float) -> None:
    fd = os.open(path, os.O_RDWR)
    lock(fd)
    ready.set()
    time.sleep(seconds)
    unlock(fd)


def _holder(path: Path, seconds: float) -> BaseProcess:
    """A process holding the file's lock for `seconds`, started and holding it on return."""
    ready = _CTX.Event()
    holder = _CTX.Process(target=_hold, args=(str(path), ready, seconds))
    holder.start()
    assert ready.wait(30)
    return holder


def _take(path: Path) -> float:
    """Seconds this process waited for the file's lock."""
    fd = os.open(path, os.O_RDWR)
    try:
        t0 = time.monotonic()
        lock(fd)
        waited = time.monotonic() - t0
        unlock(fd)
    finally:
        os.close(fd)
    return waited


def test_a_waiter_gets_the_lock_once_its_holder_lets_go(tmp_path: Path) -> None:
    path = tmp_path / "table"
    path.write_bytes(bytes(8))
    holder = _holder(path, 0.3)
    assert _take(path) >= 0.2  # past its tries, into the kernel's wait, till the holder let go
    holder.join(30)
    assert holder.exitcode == 0


def test_a_holder_killed_leaves_no_lock(tmp_path: Path) -> None:
    path = tmp_path / "table"
    path.write_bytes(bytes(8))
    holder = _holder(path, 3600)
    assert holder.pid is not None
    killer = threading.Timer(0.2, os.kill, (holder.pid, signal.SIGKILL))
    killer.start()
    try:
        assert _take(path) >= 0.1  # the kernel let go of the dead holder's lock
    finally:
        killer.join()
        holder.join(30)
    assert holder.exitcode == -signal.SIGKILL


def test_a_bad_descriptor_is_an_error() -> None:
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(OSError) as got:
        lock(r)
    assert got.value.errno == errno.EBADF
