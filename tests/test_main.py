"""The app's startup: the generated admin token is shown once to a person at a terminal, never to
the log stream; a serving process freezes what startup built out of the collector's sight; FastAPI's
own telemetry stays off (the app traces through its own providers)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from app.main import create_app
from tests.helpers import make_settings


async def _start(database_url: str, data_dir: Path, **overrides: object) -> str:
    settings = make_settings(database_url, data_dir, admin_token=None, max_workers=1, **overrides)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        pass
    return (data_dir / "admin_token").read_text().strip()


@pytest.mark.slow
async def test_generated_token_stays_out_of_the_log_stream(
    database_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.INFO)
    token = await _start(database_url, tmp_path, log_format="json")  # stderr here is no terminal
    err = capsys.readouterr().err
    assert token not in err
    assert all(token not in r.getMessage() for r in caplog.records)
    saved = [r.getMessage() for r in caplog.records if "admin token" in r.getMessage()]
    assert saved and str((tmp_path / "admin_token").resolve()) in saved[0]


@pytest.mark.slow
async def test_generated_token_is_shown_once_on_a_terminal(
    database_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    token = await _start(database_url, tmp_path, log_format="console")
    assert token in capsys.readouterr().err
    assert all(token not in r.getMessage() for r in caplog.records)
    assert await _start(database_url, tmp_path, log_format="console") == token
    assert token not in capsys.readouterr().err  # the second start does not show it again


_FREEZE_PROBE = """
import asyncio, gc, sys
before = gc.get_freeze_count()  # the interpreter's own (375 on Python 3.12, 0 before)
from app.main import create_app
from tests.helpers import make_settings

async def main(freeze):
    app = create_app(make_settings(sys.argv[1], sys.argv[2], max_workers=1), freeze_heap=freeze)
    async with app.router.lifespan_context(app):
        print(gc.get_freeze_count() - before)

asyncio.run(main(sys.argv[3] == "1"))
"""


@pytest.mark.slow
@pytest.mark.parametrize("freeze", [True, False])
def test_a_serving_process_freezes_what_startup_built(server_database_url: str, tmp_path: Path, freeze: bool) -> None:
    """A front (and the one-process node) moves its startup heap out of the cyclic collector's
    sight, so a full collection under load walks only what came since; an app built for tests
    does not (it would keep every test's garbage)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", _FREEZE_PROBE, server_database_url, str(tmp_path), "1" if freeze else "0"],
        cwd=root, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    frozen = int(out.stdout.strip().splitlines()[-1])
    assert frozen > 10_000 if freeze else frozen == 0


def test_fastapis_own_telemetry_stays_off_when_a_global_provider_is_set(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator's global OpenTelemetry setup must not add FastAPI's spans and metrics to the
    app's own (app/observability): they would double each request's span, on every request."""
    from fastapi import FastAPI
    from fastapi.telemetry import _asgi
    from opentelemetry.sdk.trace import TracerProvider

    monkeypatch.setattr(_asgi.trace, "get_tracer_provider", lambda: TracerProvider())
    assert FastAPI()._native_telemetry.enabled()  # what a plain FastAPI app would do
    app = create_app(make_settings(database_url, tmp_path, max_workers=1))
    assert not app._native_telemetry.enabled()
