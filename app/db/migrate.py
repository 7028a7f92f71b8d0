"""Run Alembic migrations programmatically (used by ``tensorwasm migrate`` and ``serve``)."""

from __future__ import annotations

from alembic import command
from alembic.config import Config

from app.settings import REPO_ROOT


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(REPO_ROOT / "migrations"))
    cfg.attributes["database_url"] = database_url
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)
