"""Run Alembic migrations programmatically (used by ``tensorwasm migrate`` and ``serve``)."""

from __future__ import annotations

from importlib import resources

from alembic import command
from alembic.config import Config


def script_location() -> str:
    """The migration scripts: package data of ``app.migrations``, installed or in a checkout."""
    return str(resources.files("app.migrations"))


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", script_location())
    cfg.attributes["database_url"] = database_url
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)
