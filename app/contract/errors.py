"""Domain errors of the invoke path. They know nothing of HTTP: app/api maps them to statuses."""

from __future__ import annotations

from enum import StrEnum


class RejectReason(StrEnum):
    CONCURRENCY = "concurrency"
    FAIR_SHARE = "fair_share"
    QUEUE_FULL = "queue_full"
    RATE = "rate"
    BODY_BYTES = "body_bytes"  # the tenant's bodies in flight in one front


class Rejected(Exception):
    """The call was not run; the caller may retry after `retry_after` seconds."""

    def __init__(self, reason: RejectReason | str, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.reason = RejectReason(reason)
        self.message = message
        self.retry_after = retry_after


class NoCapacity(Exception):
    """No worker could be bound for this tenant in time (node full or GPU admission)."""


class HardTimeout(Exception):
    """The call overran its hard deadline; its worker was killed and replaced."""


class WorkerCrashed(Exception):
    """The worker died or broke the protocol while running the call; it was replaced."""


class SupervisorGone(Exception):
    """A front lost its connection to the node's supervisor."""
