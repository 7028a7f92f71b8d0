"""Alembic environment: one migration tree for SQLite (batch mode) and PostgreSQL."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from app.db.models import Base
from app.db.session import install_sqlite_pragmas, sync_url

config = context.config
url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
if not url:
    from app.settings import get_settings

    url = get_settings().resolved_database_url


def run_migrations() -> None:
    engine = create_engine(sync_url(url), poolclass=pool.NullPool)
    install_sqlite_pragmas(engine)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            render_as_batch=connection.dialect.name == "sqlite",
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


run_migrations()
