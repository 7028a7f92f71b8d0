"""The generated admin token is shown once to a person at a terminal, never to the log stream."""

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
