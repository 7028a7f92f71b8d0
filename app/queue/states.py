"""Invocation modes and statuses (docs/architecture.md, "Async invocations and streaming"), stored as their string values."""

from __future__ import annotations

from enum import StrEnum

# runs of one async invocation when its node is lost mid-run (a function setting): 1 = never again
DEFAULT_MAX_ATTEMPTS = 3
MAX_ATTEMPTS = 10


class InvocationMode(StrEnum):
    SYNC = "sync"
    STREAM = "stream"
    ASYNC = "async"


class InvocationStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    GUEST_ERROR = "guest_error"
    TIMEOUT = "timeout"
    OUTPUT_LIMIT = "output_limit"
    DEVICE_ERROR = "device_error"
    WORKER_CRASHED = "worker_crashed"
    INTERNAL_ERROR = "internal_error"
    CLIENT_CLOSED = "client_closed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"
    NOT_FOUND = "not_found"  # the function was deleted before its queued invocation ran

    @property
    def ended(self) -> bool:
        return self not in (InvocationStatus.QUEUED, InvocationStatus.RUNNING)
