"""A run watched on its caller's connection stops its guest when the connection turns readable
(the front half-closes it when its caller went away), and only that run."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.contract.messages import Run
from app.runtime.artifacts import ArtifactCache
from app.runtime.engine import make_engine
from app.runtime.runner import GuestRunner
from tests.helpers import compile_artifact, wat


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GuestRunner, dict[str, str]]]:
    cache = ArtifactCache(Path(tmp_path_factory.mktemp("runner")))
    shas = {name: compile_artifact(cache, wat(name)) for name in ("loop", "echo")}
    yield GuestRunner(make_engine(), cache, None, 5), shas


def _run(sha: str, timeout_ms: int = 30_000) -> Run:
    return Run("inv", "f", sha, {}, timeout_ms, 1 << 20, 1 << 20, 1 << 16)


def test_a_half_closed_connection_stops_the_guest(runner: tuple[GuestRunner, dict[str, str]]) -> None:
    r, shas = runner
    front, worker = socket.socketpair()
    with front, worker:
        threading.Timer(0.2, front.shutdown, args=(socket.SHUT_WR,)).start()
        t0 = time.monotonic()
        res = r.run(_run(shas["loop"]), b"", watch=worker.fileno())
        took = time.monotonic() - t0
    assert res.status == "cancelled", res.error
    assert res.error == "the caller went away; the guest was stopped"
    assert 0.15 < took < 2.0  # at the half-close, not at the 30 s limit


def test_a_stop_is_for_its_own_run_only(runner: tuple[GuestRunner, dict[str, str]]) -> None:
    r, shas = runner
    front, worker = socket.socketpair()
    with front, worker:
        assert r.run(_run(shas["echo"]), b"hi", watch=worker.fileno()).status == "ok"
        front.shutdown(socket.SHUT_WR)  # after its run ended: nothing to stop
        time.sleep(0.05)
        # the next run, unwatched, keeps its own time limit
        res = r.run(_run(shas["loop"], timeout_ms=300), b"")
    assert res.status == "timeout", res.error
    res = r.run(_run(shas["echo"]), b"again")
    assert res.status == "ok" and bytes(res.stdout) == b"again"


def test_an_unwatched_run_times_out_as_before(runner: tuple[GuestRunner, dict[str, str]]) -> None:
    r, shas = runner
    t0 = time.monotonic()
    res = r.run(_run(shas["loop"], timeout_ms=200), b"")
    assert res.status == "timeout"
    assert "time limit of 200 ms" in (res.error or "")
    assert time.monotonic() - t0 < 2.0


def test_an_idle_workers_ticker_parks_and_the_next_guest_still_keeps_its_time_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.runtime import runner as runner_module

    monkeypatch.setattr(runner_module, "PARK_AFTER_S", 0.1)
    cache = ArtifactCache(tmp_path)
    loop = compile_artifact(cache, wat("loop"))
    r = GuestRunner(make_engine(), cache, None, 5)
    ticker = r._ticker
    deadline = time.monotonic() + 5
    while not ticker.parked:
        assert time.monotonic() < deadline, "the idle ticker never parked"
        time.sleep(0.02)
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(0.5)
    assert time.process_time() - cpu0 < 0.05 * (time.monotonic() - wall0)  # parked: no ticks
    t0 = time.monotonic()
    res = r.run(_run(loop, timeout_ms=200), b"")
    assert res.status == "timeout" and time.monotonic() - t0 < 2.0  # woken by the run, on time
    front, worker = socket.socketpair()
    with front, worker:
        while not ticker.parked:  # parked again, then a watched run: its stop still comes
            time.sleep(0.02)
        threading.Timer(0.2, front.shutdown, args=(socket.SHUT_WR,)).start()
        res = r.run(_run(loop), b"", watch=worker.fileno())
    assert res.status == "cancelled", res.error


def test_a_guest_that_keeps_writing_stops_at_its_time_limit_while_the_ticker_waits_for_the_gil(tmp_path: Path) -> None:
    """A loop of writes holds the GIL for most of each tick, and here a busy thread takes it
    too: the ticker wakes late, and the epoch must still follow the clock (counting wake-ups
    ran such guests 25% to 2x past their limit, past the front's hard deadline)."""
    cache = ArtifactCache(tmp_path)
    sha = compile_artifact(cache, wat("write_loop"))
    r = GuestRunner(make_engine(), cache, None, 5)
    stop = threading.Event()

    def busy() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    burner = threading.Thread(target=busy, daemon=True)
    burner.start()
    try:
        t0 = time.monotonic()
        res = r.run(_run(sha, timeout_ms=1000), b"")
        took = time.monotonic() - t0
    finally:
        stop.set()
        burner.join()
    assert res.status == "timeout", res.error
    assert took < 1.25, took  # within the hard deadline's grace, as measured against its 1 s limit
