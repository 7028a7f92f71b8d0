"""Which database failures are passing ones: the same request may succeed when retried."""

from __future__ import annotations

from sqlalchemy.exc import OperationalError

# SQLite: another connection held the database-wide write lock past the busy timeout
_SQLITE_BUSY = ("database is locked", "database table is locked", "database is busy")
# PostgreSQL: a lock wait timed out, a serialization failure or deadlock (the transaction was
# rolled back), the server shutting down or starting up
_PG_PASSING = {"55P03", "40001", "40P01", "57P01", "57P02", "57P03"}


def unavailable(exc: OperationalError) -> bool:
    """The database was busy or out of reach, not wrong: a lock, a dropped connection."""
    if exc.connection_invalidated:
        return True
    orig = exc.orig
    sqlstate = getattr(orig, "sqlstate", "")
    if sqlstate in _PG_PASSING or (hasattr(orig, "sqlstate") and sqlstate is None):  # no SQLSTATE: a connection failure
        return True
    if str(getattr(orig, "sqlite_errorname", "")).startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return True
    text = str(orig).lower()  # a driver that gives no error name
    return any(s in text for s in _SQLITE_BUSY)
