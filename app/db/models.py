"""SQLAlchemy models: the data model (docs/architecture.md, "Data": tenants, keys, functions, kernels, invocations)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.sql.expression import false

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always an aware UTC datetime in Python, on every database.

    SQLite keeps no zone (it reads back naive values) and PostgreSQL answers in the session's
    zone; both come back here as UTC, so a value renders the same whether it was just written
    or read back. Naive values written are taken as UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def new_id() -> str:
    return uuid.uuid4().hex


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    gpu_memory_bytes: Mapped[int] = mapped_column(BigInteger)
    max_concurrency: Mapped[int] = mapped_column(Integer)
    requests_per_second: Mapped[float] = mapped_column(Float)
    max_functions: Mapped[int] = mapped_column(Integer)
    max_module_bytes: Mapped[int] = mapped_column(BigInteger)
    wasm_memory_bytes: Mapped[int] = mapped_column(BigInteger)
    timeout_ms: Mapped[int] = mapped_column(Integer)
    max_queued: Mapped[int] = mapped_column(Integer, server_default="1000")
    max_stored_bytes: Mapped[int] = mapped_column(BigInteger, server_default=str(1024**3))
    max_files_bytes: Mapped[int] = mapped_column(BigInteger, server_default=str(64 * 1024**2))
    scratch_bytes: Mapped[int] = mapped_column(BigInteger, server_default=str(16 * 1024**2))
    max_secrets: Mapped[int] = mapped_column(Integer, server_default="100")
    max_secret_bytes: Mapped[int] = mapped_column(BigInteger, server_default=str(1024**2))  # of all its values
    gpu_weight: Mapped[int] = mapped_column(Integer, server_default="1")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(16), index=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class Function(Base):
    __tablename__ = "functions"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(63))
    current_version: Mapped[int] = mapped_column(Integer, default=1)
    env: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    content_type: Mapped[str] = mapped_column(String(255), default="application/octet-stream")
    timeout_ms: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # argv after the function's name, unless a call passes its own
    args: Mapped[list[str]] = mapped_column(JSON, default=list, server_default="[]")
    # the request variables (QUERY_STRING, CONTENT_TYPE, TW_*) are added to its environment
    cgi: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # each call gets a writable copy of its files, not the read-only bundle
    scratch: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    files_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # runs of one async invocation at most: a node lost mid-run queues it again until then
    max_attempts: Mapped[int] = mapped_column(Integer, default=3, server_default="3")
    # names of the tenant's secrets its guest gets as variables (the active version's)
    secrets: Mapped[list[str]] = mapped_column(JSON, default=list, server_default="[]")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)


class FunctionFiles(Base):
    """A function's file bundle: the tar archive as uploaded (checked), one per function."""

    __tablename__ = "function_files"

    function_id: Mapped[str] = mapped_column(ForeignKey("functions.id", ondelete="CASCADE"), primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(BigInteger)  # of the archive, counted against max_stored_bytes
    unpacked_bytes: Mapped[int] = mapped_column(BigInteger)  # of its files' contents
    entries: Mapped[int] = mapped_column(Integer)
    archive: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class FunctionVersion(Base):
    """An immutable version: its module and the settings a call of it runs with. The function's
    own columns (env, args, ...) are a copy of its active version's."""

    __tablename__ = "function_versions"
    __table_args__ = (UniqueConstraint("function_id", "version"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    function_id: Mapped[str] = mapped_column(
        ForeignKey("functions.id", ondelete="CASCADE"), index=True
    )
    version: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(BigInteger)
    module: Mapped[bytes] = mapped_column(LargeBinary)
    env: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict, server_default="{}")
    args: Mapped[list[str]] = mapped_column(JSON, default=list, server_default="[]")
    cgi: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    scratch: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    content_type: Mapped[str] = mapped_column(String(255), default="application/octet-stream", server_default="application/octet-stream")
    timeout_ms: Mapped[int | None] = mapped_column(Integer, nullable=True)
    secrets: Mapped[list[str]] = mapped_column(JSON, default=list, server_default="[]")  # names, never values
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Secret(Base):
    """A tenant's secret: its value sealed with the node key (app/services/secrets.py)."""

    __tablename__ = "secrets"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    ciphertext: Mapped[bytes] = mapped_column(LargeBinary)
    size: Mapped[int] = mapped_column(Integer)  # of the value, counted against max_secret_bytes
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)


class Kernel(Base):
    __tablename__ = "kernels"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(63))
    source: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)


_ASYNC_ROW = text("mode = 'async'")


class Invocation(Base):
    __tablename__ = "invocations"
    __table_args__ = (
        Index("ix_invocations_tenant_function_started", "tenant_id", "function", "started_at"),
        Index("ix_invocations_tenant_created", "tenant_id", "created_at", "id"),
        # the async queue's (queries by status name the mode, so these serve them): a synchronous
        # call's record (most rows) skips both
        Index("ix_invocations_status_created", "status", "created_at", sqlite_where=_ASYNC_ROW, postgresql_where=_ASYNC_ROW),
        Index("ix_invocations_tenant_status", "tenant_id", "status", sqlite_where=_ASYNC_ROW, postgresql_where=_ASYNC_ROW),
        # only async submits carry a key: a synchronous call's record (most rows) skips this index
        Index(
            "uq_invocations_tenant_idempotency_key", "tenant_id", "idempotency_key", unique=True,
            sqlite_where=text("idempotency_key IS NOT NULL"), postgresql_where=text("idempotency_key IS NOT NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    # no index of its own: every index above starts with it (one less B-tree per record written)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    function: Mapped[str] = mapped_column(String(63))
    version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    pinned_version: Mapped[int | None] = mapped_column(Integer, nullable=True)  # async: X-Function-Version
    mode: Mapped[str] = mapped_column(String(16), default="sync", server_default="sync")
    status: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    duration_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    stderr_tail: Mapped[str | None] = mapped_column(Text, nullable=True)
    # async invocations only: the request, kept until it ran; the output, kept for the retention
    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    query_string: Mapped[str | None] = mapped_column(Text, nullable=True)
    args: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)  # X-Function-Args, if given
    request_content_type: Mapped[str | None] = mapped_column(String(255), nullable=True)
    input: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    # bytes of the stored stdout, kept in slices (InvocationOutput); None: none is kept (expired)
    output_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    content_type: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # the node running it, its lease (renewed while it runs) and a cancel asked from any node
    claimed_by: Mapped[str | None] = mapped_column(String(64), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # async: the run this is (0 while first queued) of at most max_attempts (the function's at the
    # submit), and the runs before it that their node lost ({attempt, node, started_at, lost_at})
    attempt: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    max_attempts: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    lost_attempts: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)


OUTPUT_SLICE = 1 << 20


class InvocationOutput(Base):
    """A slice of an async invocation's stdout (at most OUTPUT_SLICE bytes). Written a statement a
    slice and read back one at a time: a blob bound or fetched whole is copied by the database
    drivers (on PostgreSQL read as hex text, twice its size), so a whole output never was."""

    __tablename__ = "invocation_outputs"

    invocation_id: Mapped[str] = mapped_column(ForeignKey("invocations.id", ondelete="CASCADE"), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class Node(Base):
    """A node of the cluster and its heartbeat: a node not seen for TENSORWASM_NODE_DEAD_AFTER_S
    is dead, and the async work it held is queued again."""

    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)


class FunctionLog(Base):
    """What one call of a function wrote to stderr (its tail, as its record keeps it), for
    `GET /v1/functions/{name}/logs`. Each tenant's rows are kept within TENSORWASM_LOG_BYTES_PER_TENANT,
    the oldest deleted first; `id` orders them, so a follower asks only for ids past its last."""

    __tablename__ = "function_logs"
    __table_args__ = (Index("ix_function_logs_tenant_function_id", "tenant_id", "function", "id"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    function: Mapped[str] = mapped_column(String(63))
    invocation_id: Mapped[str] = mapped_column(String(32))
    version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime())  # when the call ended
    text: Mapped[str] = mapped_column(Text)
    size: Mapped[int] = mapped_column(Integer)  # UTF-8 bytes of text, counted against the budget


class CallbackSecret(Base):
    """A tenant's key for signing callbacks (HMAC-SHA256), made at its first use, replaced by a
    rotation, sealed with the node key (app/services/callbacks.py, CallbackSecrets)."""

    __tablename__ = "callback_secrets"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    ciphertext: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    secret: Mapped[str | None] = mapped_column(String(128), nullable=True)  # in clear, from before 0011: sealed at its first read
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class CallbackDelivery(Base):
    """The callback of an async invocation submitted with X-Callback-Url: written with the
    invocation, sent once it ended (by whichever node's dispatcher claims it first), retried
    with back-off until delivered or past TENSORWASM_CALLBACK_RETRY_S."""

    __tablename__ = "callback_deliveries"
    __table_args__ = (Index("ix_callback_deliveries_status_next", "status", "next_attempt_at"),)

    invocation_id: Mapped[str] = mapped_column(ForeignKey("invocations.id", ondelete="CASCADE"), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(String(2048))
    status: Mapped[str] = mapped_column(String(16))  # app.services.callbacks.CallbackStatus
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # not before this; a claim moves it ahead by the send timeout, so one node sends at a time
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime())
    first_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
