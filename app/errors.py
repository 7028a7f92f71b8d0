"""Domain errors: what went wrong in a service or the queue, said without HTTP.

Services and the queue raise these; only the routers' layer (app/api/errors.py) turns them into
statuses, headers and the error envelope. Each kind says *how* an operation failed (missing,
conflicting, refused, invalid, limited, gone, unavailable now), `code` says *which* failure it
was (the envelope's snake_case code, a kind's default unless given), and `message` says what
went wrong and what to do about it. `retry_after` is set where trying again later can succeed.

The invoke path's own refusals (`Rejected`, `NoCapacity`, ...) live in app/contract/errors.py:
they cross process boundaries and carry their own fields.
"""

from __future__ import annotations

from typing import Self


class DomainError(Exception):
    """An operation failed for a reason the caller can act on; a subclass says which kind."""

    code: str = "error"

    def __init__(self, message: str, *, code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code  # shadows the kind's default for this instance only
        self.retry_after = retry_after  # seconds; None: trying the same again will fail the same way


class NotFound(DomainError):
    """No such resource for this caller (another tenant's resources are missing too)."""

    code = "not_found"

    @classmethod
    def of(cls, what: str) -> Self:
        """The plain "<what> not found", e.g. `NotFound.of("tenant")`."""
        return cls(f"{what} not found")


class Conflict(DomainError):
    """The request contradicts the resource's current state (a taken name, a finished run)."""

    code = "conflict"


class Forbidden(DomainError):
    """The caller may not do this now: its tenant is disabled or a quota is used up."""

    code = "forbidden"


class Invalid(DomainError):
    """The input itself is wrong (a bad module, a setting out of range); resending it fails again."""

    code = "validation_error"


class LimitReached(DomainError):
    """A limit that frees up over time was hit; the same request can succeed after `retry_after`."""

    code = "rate_limited"


class Gone(DomainError):
    """The resource existed but its data was deleted (e.g. an output past its retention)."""

    code = "expired"


class Unavailable(DomainError):
    """A dependency cannot serve now (e.g. the compiler); the same request can succeed later."""

    code = "unavailable"
