"""Request and response bodies of the HTTP API."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.queue.states import InvocationMode, InvocationStatus
from app.services.principal import QUOTA_BOUNDS, QUOTA_MINIMUMS

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,63}$"
# Resource ids (hex today); anything else is refused before it reaches a query.
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


_B, _M = QUOTA_BOUNDS, QUOTA_MINIMUMS


class Quota(BaseModel):
    """Per-tenant limits. In a PUT, an omitted field takes the platform default."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    gpu_memory_bytes: int = Field(ge=_M["gpu_memory_bytes"], le=_B["gpu_memory_bytes"], description="cap on live GPU buffer bytes; 0 = no GPU access")
    max_concurrency: int = Field(ge=_M["max_concurrency"], le=_B["max_concurrency"], description="invocations running at once")
    requests_per_second: float = Field(ge=_M["requests_per_second"], le=_B["requests_per_second"], description="token-bucket invoke rate (burst = 2 s)")
    max_functions: int = Field(ge=_M["max_functions"], le=_B["max_functions"], description="deployed functions")
    max_module_bytes: int = Field(ge=_M["max_module_bytes"], le=_B["max_module_bytes"], description="size of one uploaded module")
    wasm_memory_bytes: int = Field(ge=_M["wasm_memory_bytes"], le=_B["wasm_memory_bytes"], description="linear memory one instance may grow to")
    timeout_ms: int = Field(ge=_M["timeout_ms"], le=_B["timeout_ms"], description="wall-clock limit of one invocation")
    max_queued: int = Field(ge=_M["max_queued"], le=_B["max_queued"], description="async invocations accepted and not yet started (global)")


class QuotaUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    gpu_memory_bytes: int | None = Field(default=None, ge=_M["gpu_memory_bytes"], le=_B["gpu_memory_bytes"])
    max_concurrency: int | None = Field(default=None, ge=_M["max_concurrency"], le=_B["max_concurrency"])
    requests_per_second: float | None = Field(default=None, ge=_M["requests_per_second"], le=_B["requests_per_second"])
    max_functions: int | None = Field(default=None, ge=_M["max_functions"], le=_B["max_functions"])
    max_module_bytes: int | None = Field(default=None, ge=_M["max_module_bytes"], le=_B["max_module_bytes"])
    wasm_memory_bytes: int | None = Field(default=None, ge=_M["wasm_memory_bytes"], le=_B["wasm_memory_bytes"])
    timeout_ms: int | None = Field(default=None, ge=_M["timeout_ms"], le=_B["timeout_ms"])
    max_queued: int | None = Field(default=None, ge=_M["max_queued"], le=_B["max_queued"])


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    quota: QuotaUpdate | None = None


class TenantUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, pattern=NAME_PATTERN)
    disabled: bool | None = None


class TenantOut(BaseModel):
    id: str
    name: str
    disabled: bool
    quota: Quota
    created_at: datetime
    updated_at: datetime


class ApiKeyCreated(BaseModel):
    id: str
    key: str = Field(description="the secret; shown only in this response")
    prefix: str
    created_at: datetime


class ApiKeyOut(BaseModel):
    id: str
    prefix: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


class FunctionOut(BaseModel):
    name: str
    version: int
    sha256: str
    size: int
    env: dict[str, str]
    content_type: str
    timeout_ms: int | None
    created_at: datetime
    updated_at: datetime
    versions: list[FunctionVersionOut] | None = None


class FunctionVersionOut(BaseModel):
    version: int
    sha256: str
    size: int
    created_at: datetime


class InvocationOut(BaseModel):
    id: str
    function: str
    version: int | None
    mode: InvocationMode
    status: InvocationStatus
    created_at: datetime = Field(description="when it was received (async: queued)")
    started_at: datetime | None = Field(description="when it started running; null while queued")
    ended_at: datetime | None
    duration_ms: float | None
    exit_code: int | None
    error: str | None
    stderr_tail: str | None


class InvocationPage(BaseModel):
    items: list[InvocationOut]
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null on the last")


class KernelOut(BaseModel):
    name: str
    sha256: str
    size: int
    created_at: datetime
    updated_at: datetime
    source: str | None = None


class WorkerOut(BaseModel):
    id: str
    pid: int | None
    state: str
    backend: str
    device: int = Field(description="the node's device the worker is pinned to (0 on a CPU node)")
    tenant_id: str | None
    tenant: str | None
    gpu_bytes_in_use: int
    gpu_bytes_cap: int
    invocations: int
    started_at: datetime


class UsageOut(BaseModel):
    tenant: str
    quota: Quota
    functions: int
    kernels: int
    running: int
    queued: int
    async_queued: int = Field(description="async invocations accepted and not yet started (all nodes)")
    async_running: int = Field(description="async invocations running (all nodes)")
    workers: int
    gpu_bytes_in_use: int


class DeviceOut(BaseModel):
    index: int
    name: str
    status: str = Field(description="ok | at_ceiling (holds as many contexts as it may) | backing_off (a start failed)")
    contexts: int = Field(description="worker contexts on it, starting ones included")
    ceiling: int = Field(description="contexts it may hold, configured or learned from a refusal; 0 = none")
    committed_bytes: int
    budget_bytes: int = Field(description="device memory contexts may be promised; 0 = unlimited (CPU)")
    start_failures: int = Field(description="consecutive failed starts")


class Health(BaseModel):
    status: str
    detail: dict[str, Any] = {}


class Ready(Health):
    devices: list[DeviceOut] = Field(description="this node's devices (one on a CPU node)")


class ErrorBody(BaseModel):
    code: str = Field(description="snake_case error code")
    message: str = Field(description="what went wrong and what to do")
    exit_code: int | None = Field(default=None, description="invoke errors: the guest's exit code, where known")
    stderr_tail: str | None = Field(default=None, description="invoke errors: the end of the guest's stderr")


class ErrorEnvelope(BaseModel):
    """Every error the API answers."""

    error: ErrorBody
