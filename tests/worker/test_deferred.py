"""A worker's backend warm-up left off its start (cuBLAS's handle on CUDA) is done once the worker
has waited a moment with nothing to do, once, and a failing one does not stop the worker."""

from __future__ import annotations

import io
import logging
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.worker import main
from app.worker.main import _serve_fronts, _Worker

IDLE_S = 0.05


@pytest.fixture(autouse=True)
def _short_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(main, "IDLE_WORK_AFTER_S", IDLE_S)


def _serve(tmp_path: Path, warm: object) -> tuple[threading.Thread, int]:
    worker = _Worker(runner=None, host=SimpleNamespace(backend=SimpleNamespace(warm_idle=warm)), memory=None, stats=None)
    r, w = os.pipe()
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
