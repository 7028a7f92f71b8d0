"""Request-scoped values that every log line and span carries."""

from __future__ import annotations

from contextvars import ContextVar

request_id: ContextVar[str | None] = ContextVar("request_id", default=None)
tenant: ContextVar[str | None] = ContextVar("tenant", default=None)
invocation_id: ContextVar[str | None] = ContextVar("invocation_id", default=None)
