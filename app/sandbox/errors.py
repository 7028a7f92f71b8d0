"""What can go wrong in a sandboxed compile, as domain errors (HTTP mapping lives in services)."""

from __future__ import annotations

from enum import StrEnum

# How a failed allocation reads: the Rust compiler's abort message, an error it returned, or
# a C++ compiler's uncaught std::bad_alloc.
_OOM_MARKERS = ("memory allocation of", "cannot allocate memory", "os error 12", "out of memory", "bad_alloc")


def looks_like_oom(message: str) -> bool:
    low = message.lower()
    return any(m in low for m in _OOM_MARKERS)


class CompileOutcome(StrEnum):
    """The label `outcome` of `tensorwasm_compiles_total`."""

    OK = "ok"
    INVALID = "invalid"  # the code was refused on its merits (validation, compiler errors)
    MEMORY = "memory"  # the memory limit was hit
    TIMEOUT = "timeout"  # the time limit was hit; the child was killed
    CRASHED = "crashed"  # the child died for another reason
    UNAVAILABLE = "unavailable"  # no child could be started


class Limit(StrEnum):
    MEMORY = "memory"
    TIME = "time"


class SandboxError(Exception):
    """A compile did not produce a verdict on the code itself."""


class LimitExceeded(SandboxError):
    """The compile needed more memory or time than the node allows."""

    def __init__(self, limit: Limit, value: float) -> None:
        self.limit = limit
        self.value = value
        super().__init__(self.describe("the code"))

    @property
    def outcome(self) -> CompileOutcome:
        return CompileOutcome.MEMORY if self.limit is Limit.MEMORY else CompileOutcome.TIMEOUT

    def describe(self, what: str) -> str:
        """A sentence for the tenant naming the limit and the setting that holds it."""
        if self.limit is Limit.MEMORY:
            return f"compiling {what} needed more than {int(self.value)} bytes of memory (TENSORWASM_COMPILE_MEMORY_BYTES)"
        return f"compiling {what} took longer than {self.value:g} s (TENSORWASM_COMPILE_TIMEOUT_S)"


class SandboxCrashed(SandboxError):
    """The child died without an answer and not for a limit (a compiler fault)."""


class SandboxUnavailable(SandboxError):
    """No compile process could be started (a fault of the node, not of the code)."""
