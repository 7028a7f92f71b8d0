"""Migrations run up and down on SQLite and (when configured) PostgreSQL."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from app.db.migrate import downgrade, upgrade
from app.db.models import Base
from app.db.session import sync_url
from tests.helpers import fresh_postgres_database

TABLES = {"tenants", "api_keys", "functions", "function_versions", "function_files", "kernels", "invocations", "invocation_outputs", "nodes"}
TABLES |= {"secrets"}  # 0008
TABLES |= {"function_logs", "callback_secrets", "callback_deliveries"}  # 0009


def _tables(url: str) -> set[str]:
    engine = create_engine(sync_url(url))
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _roundtrip(url: str) -> None:
    upgrade(url)
    assert _tables(url) == TABLES == set(Base.metadata.tables)
    downgrade(url, "base")
    assert _tables(url) == set()
    upgrade(url)
    assert _tables(url) == TABLES


def test_migrations_sqlite(tmp_path: Path) -> None:
    _roundtrip(f"sqlite:///{tmp_path / 'm.db'}")


@pytest.mark.skipif(not os.environ.get("TENSORWASM_TEST_DATABASE_URL"), reason="set TENSORWASM_TEST_DATABASE_URL to test PostgreSQL")
def test_migrations_postgres() -> None:
    url, drop = fresh_postgres_database(os.environ["TENSORWASM_TEST_DATABASE_URL"])
    try:
        _roundtrip(url)
    finally:
        drop()


def test_models_match_migrations(tmp_path: Path) -> None:
    """Autogenerate finds nothing to do: the migration tree and the models agree."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    url = f"sqlite:///{tmp_path / 'cmp.db'}"
    upgrade(url)
    engine = create_engine(sync_url(url))
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == []
