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


# The longest a statement waits for a lock another connection holds (a front stopped in the middle
# of a write holds it for good): past it the request answers 503 with Retry-After (app/db/errors.py).
LOCK_WAIT_MS = 5000


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:  # the driver's own connection: untyped in the event API
    cursor = dbapi_connection.cursor()
    # the wait first: the journal-mode switch below needs a lock that another front's
    # connection may hold while the node starts
    cursor.execute(f"PRAGMA busy_timeout={LOCK_WAIT_MS}")
    # WAL lets readers run beside the batched invocation writer; FKs make cascades real.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def install_sqlite_pragmas(engine: Engine) -> None:
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)


def create_engine_for(url: str) -> AsyncEngine:
    u = make_url(url)
    backend = u.get_backend_name()
    connect_args = {}
    if backend == "postgresql":  # added to what the URL's own `options` set, if any
        given = u.query.get("options", "")
        connect_args["options"] = " ".join([*([given] if isinstance(given, str) and given else []), f"-c lock_timeout={LOCK_WAIT_MS}"])
    engine = create_async_engine(async_url(url), pool_pre_ping=backend != "sqlite", connect_args=connect_args)
    install_sqlite_pragmas(engine.sync_engine)
    return engine


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
