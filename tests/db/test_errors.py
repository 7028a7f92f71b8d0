"""Which database failures count as passing ones (answered 503 with Retry-After, not 500)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from app.db.errors import unavailable


class _PgError(Exception):
    def __init__(self, message: str, sqlstate: str | None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


def _wrapped(orig: Exception, invalidated: bool = False) -> OperationalError:
    return OperationalError("UPDATE tenants SET ...", {}, orig, connection_invalidated=invalidated)


def test_sqlites_lock_held_past_the_busy_timeout_is_passing(tmp_path: Path) -> None:
    holder = sqlite3.connect(tmp_path / "db", timeout=0, isolation_level=None)
    holder.execute("CREATE TABLE t (a)")
    holder.execute("BEGIN IMMEDIATE")
    writer = sqlite3.connect(tmp_path / "db", timeout=0)
    with pytest.raises(sqlite3.OperationalError) as busy:
        writer.execute("INSERT INTO t VALUES (1)")
    assert unavailable(_wrapped(busy.value))  # by its error name, SQLITE_BUSY
    assert unavailable(_wrapped(sqlite3.OperationalError("database is locked")))  # by the text, without one
    assert unavailable(_wrapped(sqlite3.OperationalError("database table is locked: tenants")))


def test_a_schema_or_statement_fault_is_not() -> None:
    assert not unavailable(_wrapped(sqlite3.OperationalError("no such table: tenants")))
    assert not unavailable(_wrapped(_PgError('column "x" does not exist', "42703")))


def test_postgres_lock_timeouts_rollbacks_and_lost_connections_are_passing() -> None:
    for sqlstate in ("55P03", "40001", "40P01", "57P01", "57P03"):
        assert unavailable(_wrapped(_PgError("...", sqlstate))), sqlstate
    assert unavailable(_wrapped(_PgError("connection failed: Connection refused", None)))  # no SQLSTATE: never reached the server
    assert unavailable(_wrapped(Exception("server closed the connection unexpectedly"), invalidated=True))
