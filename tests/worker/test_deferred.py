"""A worker's backend warm-up left off its start (cuBLAS's handle on CUDA) is done once the worker
has waited a moment with nothing to do, once, and a failing one does not stop the worker. A spare
wants it; a bound worker only when its bind says the tenant's calls have used it (`Bind.warm`);
a call that used it is noted on the worker's page once."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.contract.frames import write_frame
from app.contract.messages import Bind
from app.worker import main
from app.worker.main import _serve_fronts, _Worker

IDLE_S = 0.05


@pytest.fixture(autouse=True)
def _short_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(main, "IDLE_WORK_AFTER_S", IDLE_S)


class _Page:
    def __init__(self) -> None:
        self.fields: dict[str, int] = {}

    def set(self, field: str, value: int) -> None:
        self.fields[field] = value


def _worker(warm: object) -> _Worker:
    host = SimpleNamespace(
        backend=SimpleNamespace(warm_idle=warm, deferred_used=False), bind=lambda cap: None, set_kernels=lambda kernels: None,
        share=None, launches_total=0,
    )
    return _Worker(runner=None, host=host, memory=None, stats=_Page())


def _bind(warm: bool) -> Bind:
    return Bind(tenant_id="t1", tenant="one", gpu_memory_bytes=0, warm=warm)


def _serve(tmp_path: Path, warm: object, bind: Bind | None = None) -> tuple[threading.Thread, int]:
    """The worker's loop on a thread; `bind` is on its pipe before it starts."""
    worker = _worker(warm)
    r, w = os.pipe()
    if bind is not None:
        with os.fdopen(os.dup(w), "wb") as f:
            write_frame(f, bind)
    t = threading.Thread(target=_serve_fronts, args=(worker, os.fdopen(r, "rb"), io.BytesIO(), str(tmp_path / "w.sock")), daemon=True)
    t.start()
    return t, w


def test_an_idle_worker_warms_up_once(tmp_path: Path) -> None:
    calls: list[float] = []
    started = time.monotonic()
    t, pipe = _serve(tmp_path, lambda: calls.append(time.monotonic()))
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(10 * IDLE_S)
    assert len(calls) == 1
    assert calls[0] - started >= IDLE_S
    os.close(pipe)  # the supervisor's pipe closed: the worker ends
    t.join(5)
    assert not t.is_alive()


def test_a_failing_warm_up_is_logged_and_the_worker_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def fail() -> None:
        raise RuntimeError("no handle")

    with caplog.at_level(logging.WARNING):
        t, pipe = _serve(tmp_path, fail)
        deadline = time.monotonic() + 5
        while "warm-up failed" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "the backend's warm-up failed: no handle" in caplog.text
        assert t.is_alive()
        os.close(pipe)
        t.join(5)
    assert not t.is_alive()


@pytest.mark.parametrize("warm", [False, True])
def test_a_bound_worker_warms_up_only_when_its_bind_says_so(tmp_path: Path, warm: bool) -> None:
    calls: list[float] = []
    t, pipe = _serve(tmp_path, lambda: calls.append(time.monotonic()), bind=_bind(warm))
    time.sleep(10 * IDLE_S)
    assert len(calls) == (1 if warm else 0)
    os.close(pipe)
    t.join(5)
    assert not t.is_alive()


def test_a_worker_that_warmed_as_a_spare_does_not_warm_again_at_its_bind() -> None:
    calls: list[int] = []
    worker = _worker(lambda: calls.append(1))
    worker.do_deferred()  # as a spare
    worker.control(_bind(True), b"", io.BytesIO())
    assert not worker.deferred and calls == [1]
    worker = _worker(lambda: calls.append(2))
    worker.control(_bind(False), b"", io.BytesIO())  # bound before its spare's warm-up: never
    assert not worker.deferred


def test_a_call_that_used_the_deferred_set_up_is_noted_on_the_page_once() -> None:
    worker = _worker(lambda: None)
    result = SimpleNamespace(status="ok", stdout=bytearray(b"out"), stderr=b"", exit_code=0, error=None, duration_ms=1.0, host={}, spans=None)
    worker.runner = SimpleNamespace(run=lambda *_a: result, finish=lambda: None, prepare=lambda _msg: None)
    worker.memory = SimpleNamespace(scrub=lambda: None)
    run = main.Run("inv-1", "f", "0" * 64, {}, 1000, 1 << 20, 1 << 20, 1 << 10)
    worker.run(run, b"", io.BytesIO())
    assert "deferred_used" not in worker.stats.fields
    worker.host.backend.deferred_used = True  # that call ran a gemm
    worker.run(run, b"", io.BytesIO())
    assert worker.stats.fields["deferred_used"] == 1
    worker.stats.fields["deferred_used"] = 0
    worker.run(run, b"", io.BytesIO())
    assert worker.stats.fields["deferred_used"] == 0  # noted once, not at every call


def test_workers_of_a_device_warm_up_one_at_a_time(tmp_path: Path) -> None:
    """The driver makes handles one after another: a spare that finds another warming up waits
    its turn (still deferred) rather than queue at the driver behind it."""
    lock = tmp_path / "warm-up-0.lock"
    fds = [os.open(lock, os.O_RDWR | os.O_CREAT) for _ in range(2)]
    calls: list[str] = []
    second = _worker(lambda: calls.append("second"))
    second.warm_lock = fds[1]

    def first_warms() -> None:
        assert not second.do_deferred()  # the first holds the device's turn
        calls.append("first")

    first = _worker(first_warms)
    first.warm_lock = fds[0]
    assert first.do_deferred()
    assert calls == ["first"] and second.deferred and not second.warmed
    assert second.do_deferred()  # its turn now
    assert calls == ["first", "second"] and not second.deferred
    for fd in fds:
        os.close(fd)


def test_a_worker_whose_turn_is_taken_tries_again_soon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(main, "WARM_TURN_S", IDLE_S)
    lock = tmp_path / "warm-up-0.lock"
    held = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)  # another worker warming up
    calls: list[float] = []
    worker = _worker(lambda: calls.append(time.monotonic()))
    worker.warm_lock = os.open(lock, os.O_RDWR)
    r, w = os.pipe()
    t = threading.Thread(target=_serve_fronts, args=(worker, os.fdopen(r, "rb"), io.BytesIO(), str(tmp_path / "w.sock")), daemon=True)
    t.start()
    time.sleep(6 * IDLE_S)
    assert calls == [] and worker.deferred
    monkeypatch.setattr(main, "IDLE_WORK_AFTER_S", 30.0)  # only the turn's retry can warm it now
    fcntl.flock(held, fcntl.LOCK_UN)
    unlocked = time.monotonic()
    deadline = unlocked + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(calls) == 1 and not worker.deferred
    assert calls[0] - unlocked < 1.0
    os.close(w)
    t.join(5)
    assert not t.is_alive()
    os.close(held)
    os.close(worker.warm_lock)


def test_warm_ups_take_no_turns_where_the_lock_cannot_be_had(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only cache dir, or a file system without locks: the worker warms up all the same."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root writes anyway: the open cannot fail here
            assert main._warm_lock(ro) is not None
        else:
            assert main._warm_lock(ro) is None
    finally:
        ro.chmod(0o700)
    calls: list[int] = []
    worker = _worker(lambda: calls.append(1))
    worker.warm_lock = os.open(tmp_path / "warm-up-0.lock", os.O_RDWR | os.O_CREAT)

    def no_locks(fd: int, op: int) -> None:
        raise OSError(37, "No locks available")

    monkeypatch.setattr(main.fcntl, "flock", no_locks)
    assert worker.do_deferred()
    assert calls == [1] and not worker.deferred
    os.close(worker.warm_lock)
