"""Compiles of tenant code (Wasm modules, CUDA sources) in child processes with limits.

A tenant's upload is never compiled inside a serving process: each compile runs in a fresh
child (`app.sandbox.child`) under an address-space limit and a wall-clock limit, at most
`compile_concurrency` at once per node and one per tenant (`FairLimiter`). `Sandbox` is the
api process's side; `app.runtime.compiler` is what services call.
"""

from app.sandbox.client import JobKind, Sandbox, SandboxResult
from app.sandbox.errors import CompileOutcome, Limit, LimitExceeded, SandboxCrashed, SandboxError, SandboxUnavailable
from app.sandbox.limiter import FairLimiter

__all__ = [
    "CompileOutcome",
    "FairLimiter",
    "JobKind",
    "Limit",
    "LimitExceeded",
    "Sandbox",
    "SandboxCrashed",
    "SandboxError",
    "SandboxResult",
    "SandboxUnavailable",
]
