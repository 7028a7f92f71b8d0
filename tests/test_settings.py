"""Settings: the data dir holds tenants' modules, the database and the admin token, so only its owner
reads it; settings no longer read are ignored."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from app.settings import Settings


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_data_dir_is_tightened_at_every_start(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "cache").mkdir(parents=True)
    for name in ("tensorwasm.db", "tensorwasm.db-wal", "admin_token", "cache/abc.cwasm"):
        (data / name).write_text("x")
        os.chmod(data / name, 0o644)
    os.chmod(data, 0o755)
    os.chmod(data / "cache", 0o755)

    (data / "operator-notes.txt").write_text("x")
    os.chmod(data / "operator-notes.txt", 0o644)

    Settings(data_dir=data).ensure_data_dir()

    assert _mode(data) == _mode(data / "cache") == 0o700
    for name in ("tensorwasm.db", "tensorwasm.db-wal", "admin_token", "cache/abc.cwasm"):
        assert _mode(data / name) == 0o600, name
    assert _mode(data / "operator-notes.txt") == 0o644  # not ours: left alone


def test_a_new_data_dir_and_its_database_start_private(tmp_path: Path) -> None:
    data = tmp_path / "fresh"
    Settings(data_dir=data).ensure_data_dir()
    assert _mode(data) == 0o700
    assert _mode(data / "tensorwasm.db") == 0o600  # SQLite gives its WAL and shm files this mode
    token, generated = Settings(data_dir=data).ensure_admin_token()
    assert generated and _mode(data / "admin_token") == 0o600
    assert Settings(data_dir=data).ensure_admin_token() == (token, False)


def test_a_database_elsewhere_is_not_created_in_the_data_dir(tmp_path: Path) -> None:
    Settings(data_dir=tmp_path / "d", database_url="postgresql://x@127.0.0.1/y").ensure_data_dir()
    assert not (tmp_path / "d" / "tensorwasm.db").exists()


def test_default_quota_must_lie_within_the_bounds(tmp_path: Path) -> None:
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="TENSORWASM_DEFAULT_TIMEOUT_MS must be between 1 and 3600000"):
        Settings(data_dir=tmp_path, default_timeout_ms=2**40)
    with pytest.raises(ValidationError, match="TENSORWASM_DEFAULT_REQUESTS_PER_SECOND"):
        Settings(data_dir=tmp_path, default_requests_per_second=0)


def test_removed_settings_in_the_environment_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator's environment that still sets the removed lease-reuse settings starts a node."""
    for name, value in (("LEASE_HOLD_MS", "100"), ("LEASE_IDLE_MS", "5"), ("LEASE_HANDOFF_RUNS", "8")):
        monkeypatch.setenv(f"TENSORWASM_{name}", value)
    assert not hasattr(Settings(), "lease_hold_ms")
