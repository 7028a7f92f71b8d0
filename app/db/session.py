"""Engine and session factory; one URL drives both the async app and sync migrations."""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine


def async_url(url: str) -> str:
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        return str(u.set(drivername="sqlite+aiosqlite").render_as_string(hide_password=False))
    if u.get_backend_name() == "postgresql":
        return u.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    return url


def sync_url(url: str) -> str:
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        return u.set(drivername="sqlite").render_as_string(hide_password=False)
    if u.get_backend_name() == "postgresql":
        return u.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    return url


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:  # the driver's own connection: untyped in the event API
    cursor = dbapi_connection.cursor()
    # the wait first: the journal-mode switch below needs a lock that another front's
    # connection may hold while the node starts
    cursor.execute("PRAGMA busy_timeout=5000")
    # WAL lets readers run beside the batched invocation writer; FKs make cascades real.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def install_sqlite_pragmas(engine: Engine) -> None:
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)


def create_engine_for(url: str) -> AsyncEngine:
    engine = create_async_engine(async_url(url), pool_pre_ping=make_url(url).get_backend_name() != "sqlite")
    install_sqlite_pragmas(engine.sync_engine)
    return engine


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
