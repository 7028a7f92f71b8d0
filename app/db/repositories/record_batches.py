"""Invocation records as one INSERT and driver-ready values per shape of row, built before a
write takes its turn at the database (app/db/write_turn.py).

SQLAlchemy's executemany processes every row's parameters inside the statement's execution
(~33 µs a row, on the front's event loop, between the calls it serves) while the write holds
SQLite's one lock, or the node's turn at it: every other front's batch waited for that too. Here
a front builds its rows' values (a few µs a row) before it asks for the turn, and the driver
runs the statement with them as they are (`exec_driver_sql`). On an H200 host with 8 fronts
under load, a node then stopped in about 5 s instead of 10 (its fronts' backlogs written). A row with a column this does not
convert (JSON, binary, a default that must be called) goes SQLAlchemy's own way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from operator import itemgetter
from typing import Any, NamedTuple, cast

from sqlalchemy import Boolean, Float, Integer, String, Table, Text
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import Invocation, UTCDateTime

_TABLE = cast(Table, Invocation.__table__)
_MARKS = {"qmark": "?", "format": "%s", "pyformat": "%s"}


def _utc(value: datetime | None) -> datetime | None:
    """UTCDateTime's own conversion: naive taken as UTC, aware moved to UTC."""
    if value is None or value.tzinfo is UTC:
        return value
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _sqlite_time(value: datetime | None) -> str | None:
    """As SQLAlchemy's SQLite DATETIME stores it (and reads it back): in UTC, with all six digits
    of microseconds and no zone (the first 26 characters of the UTC time's ISO form)."""
    v = _utc(value)
    if v is None:
        return None
    return v.isoformat(" ", "microseconds")[:26]


def _as_is(value: Any) -> Any:
    return value


def _converter(column: Any, dialect: Dialect) -> Callable[[Any], Any] | None:
    """How a column's Python value becomes the driver's; None: not converted here."""
    if isinstance(column.type, UTCDateTime):
        return _sqlite_time if dialect.name == "sqlite" else _utc
    if isinstance(column.type, (String, Text, Integer, Float, Boolean)):  # Text is a String; BigInteger an Integer
        return _as_is
    return None


@dataclass
class RecordBatch:
    """(INSERT, value tuples) per shape of row, and the rows left to SQLAlchemy."""

    statements: list[tuple[str, list[tuple[Any, ...]]]] = field(default_factory=list)
    other: list[dict[str, Any]] = field(default_factory=list)

    def extend(self, more: RecordBatch) -> None:
        """`more`'s rows added: those of a statement this batch has join its values (one
        executemany per shape however many pieces the rows were built in)."""
        values = dict(self.statements)  # the same lists: extended in place
        for sql, rows in more.statements:
            if sql in values:
                values[sql].extend(rows)
            else:
                self.statements.append((sql, rows))
                values[sql] = rows
        self.other.extend(more.other)


def record_batch(rows: Iterable[dict[str, Any]], dialect: Dialect) -> RecordBatch:
    mark = _MARKS.get(dialect.paramstyle or "")
    batch = RecordBatch()
    # a shape is a row's keys in their order (the recorder makes each kind of row alike); two
    # orders of the same keys are two statements, each right
    shapes: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for row in rows:
        shapes.setdefault(tuple(row), []).append(row)
    for keys, group in shapes.items():
        shape = _shape(keys, dialect) if mark is not None else None
        if shape is None:
            batch.other.extend(group)
            continue
        sql, take, converted, fill = shape
        values = []
        for row in group:
            v: Any = take(row)
            if converted:
                v = list(v)
                for i, c in converted:
                    v[i] = c(v[i])
            values.append((*v, *fill))
        batch.statements.append((sql, values))
    return batch


class _Shape(NamedTuple):
    sql: str
    take: Callable[[dict[str, Any]], tuple[Any, ...]]  # the given values, in the statement's order
    converted: list[tuple[int, Callable[[Any], Any]]]  # the given values that need converting
    fill: tuple[Any, ...]  # the defaults' values, after the given ones


@functools.lru_cache(maxsize=64)
def _shape(keys: tuple[str, ...], dialect: Dialect) -> _Shape | None:
    """A shape's statement and how its rows' values are built; None when SQLAlchemy writes it.
    Kept per shape and dialect: worked out per piece it cost the front ~0.7 µs a row."""
    mark = _MARKS[dialect.paramstyle or ""]
    plan = _plan(frozenset(keys), dialect)
    if plan is None:
        return None
    names, convert, defaults = plan
    quote = dialect.identifier_preparer.quote
    sql = f"INSERT INTO {quote(_TABLE.name)} ({', '.join(quote(n) for n in names)}) VALUES ({', '.join([mark] * len(names))})"
    given = names[: len(convert)]
    # the given values in one step, then only the columns that need it converted: a call per
    # column per row cost the front ~10 µs a row on the 2-core VM
    take = itemgetter(*given) if len(given) > 1 else (lambda row, names=tuple(given): tuple(row[n] for n in names))
    converted = [(i, c) for i, c in enumerate(convert) if c is not _as_is]
    return _Shape(sql, take, converted, tuple(defaults))


def _plan(keys: frozenset[str], dialect: Dialect) -> tuple[list[str], list[Callable[[Any], Any]], list[Any]] | None:
    """The columns of a shape (those given, then those filled with their scalar defaults), each
    given one's converter and the defaults' values; None when a column is not converted here."""
    given, convert, filled, defaults = [], [], [], []
    for column in _TABLE.columns:
        if column.name in keys:
            c = _converter(column, dialect)
            if c is None:
                return None
            given.append(column.name)
            convert.append(c)
        elif column.default is not None:
            if not column.default.is_scalar:
                return None
            c = _converter(column, dialect)
            if c is None:
                return None
            filled.append(column.name)
            defaults.append(c(column.default.arg))  # type: ignore[attr-defined]  # a scalar default's value
    if len(given) != len(keys):  # a key that is no column: let SQLAlchemy say so
        return None
    return given + filled, convert, defaults


async def insert_statements(session: AsyncSession, batch: RecordBatch) -> None:
    """Within the session's transaction: each statement once, with all its rows (the rows left
    to SQLAlchemy are the caller's: InvocationRepository.insert_batch)."""
    conn = await session.connection()
    for sql, values in batch.statements:
        await conn.exec_driver_sql(sql, values)
