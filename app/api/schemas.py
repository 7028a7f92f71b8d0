"""Request and response bodies of the HTTP API."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.queue.states import InvocationMode, InvocationStatus
from app.services.callbacks import CallbackStatus
from app.services.nodes import HeartbeatState
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
    max_stored_bytes: int = Field(
        ge=_M["max_stored_bytes"], le=_B["max_stored_bytes"],
        description="bytes of stored async inputs and outputs, kept module versions and file archives (global)",
    )
    max_files_bytes: int = Field(
        ge=_M["max_files_bytes"], le=_B["max_files_bytes"], description="bytes of one function's files, unpacked",
    )
    scratch_bytes: int = Field(
        ge=_M["scratch_bytes"], le=_B["scratch_bytes"],
        description="bytes a call's writable in-memory copy of its files may hold (scratch=true); past it writes fail with ENOSPC",
    )
    max_secrets: int = Field(ge=_M["max_secrets"], le=_B["max_secrets"], description="secrets the tenant may keep")
    max_secret_bytes: int = Field(
        ge=_M["max_secret_bytes"], le=_B["max_secret_bytes"], description="bytes of all the tenant's secret values",
    )
    gpu_weight: int = Field(
        ge=_M["gpu_weight"], le=_B["gpu_weight"],
        description="the tenant's share of a device's time against other tenants' that want it (by weight, whatever its number of contexts)",
    )


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
    max_stored_bytes: int | None = Field(default=None, ge=_M["max_stored_bytes"], le=_B["max_stored_bytes"])
    max_files_bytes: int | None = Field(default=None, ge=_M["max_files_bytes"], le=_B["max_files_bytes"])
    scratch_bytes: int | None = Field(default=None, ge=_M["scratch_bytes"], le=_B["scratch_bytes"])
    max_secrets: int | None = Field(default=None, ge=_M["max_secrets"], le=_B["max_secrets"])
    max_secret_bytes: int | None = Field(default=None, ge=_M["max_secret_bytes"], le=_B["max_secret_bytes"])
    gpu_weight: int | None = Field(default=None, ge=_M["gpu_weight"], le=_B["gpu_weight"])


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


class FilesOut(BaseModel):
    sha256: str = Field(description="of the archive as uploaded")
    size: int = Field(description="bytes of the archive, counted against max_stored_bytes")
    unpacked_bytes: int = Field(description="bytes of its files' contents, counted against max_files_bytes")
    entries: int = Field(description="files, directories and symbolic links")
    created_at: datetime


class FunctionOut(BaseModel):
    name: str
    version: int
    sha256: str
    size: int
    env: dict[str, str]
    args: list[str] = Field(description="default argv after the function's name; a call may pass its own (X-Function-Args)")
    cgi: bool = Field(description="the request variables are added to the guest's environment")
    scratch: bool = Field(description="each call gets a writable in-memory copy of the files")
    files: FilesOut | None = Field(default=None, description="the file bundle the guest sees at `/`; null: none")
    content_type: str
    timeout_ms: int | None
    max_attempts: int = Field(
        description="runs of one async invocation at most: one whose node is lost mid-run is queued again until then"
    )
    secrets: list[str] = Field(default_factory=list, description="names of the tenant's secrets the guest gets as variables "
                               "(values are never shown)")
    created_at: datetime
    updated_at: datetime
    versions: list[FunctionVersionOut] | None = None


class FunctionVersionOut(BaseModel):
    """An immutable version: its module and the settings its calls run with."""

    version: int
    active: bool = Field(default=False, description="the version calls run unless they pin another")
    sha256: str
    size: int
    env: dict[str, str] = Field(default_factory=dict)
    args: list[str] = Field(default_factory=list)
    cgi: bool = False
    scratch: bool = False
    content_type: str = "application/octet-stream"
    timeout_ms: int | None = None
    secrets: list[str] = Field(default_factory=list, description="names only")
    created_at: datetime


class RollbackIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=1, le=2**31 - 1, description="a version the function keeps (GET .../versions)")


SECRET_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"


class SecretOut(BaseModel):
    """A secret's name and times; its value is never shown."""

    name: str
    size: int = Field(description="bytes of its value, counted against max_secret_bytes")
    created_at: datetime
    updated_at: datetime


class LostAttemptOut(BaseModel):
    attempt: int
    node: str | None
    started_at: datetime | None
    lost_at: datetime


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
    attempt: int = Field(
        default=1, description="async: the run this is (0 while first queued); one whose node was lost is queued again"
    )
    max_attempts: int = Field(default=1, description="async: runs at most, the function's setting at the submit")
    node: str | None = Field(default=None, description="async: the node running (or that ran) the current attempt")
    lost_attempts: list[LostAttemptOut] = Field(default_factory=list, description="async: earlier runs whose node was lost")
    callback: CallbackOut | None = Field(default=None, description="async, submitted with X-Callback-Url: its delivery")


class CallbackOut(BaseModel):
    url: str
    status: CallbackStatus = Field(description="pending (until delivered or given up), delivered, or failed")
    attempts: int = Field(description="POSTs made so far")
    last_status_code: int | None = Field(default=None, description="the receiver's answer to the last attempt")
    last_error: str | None = Field(default=None, description="why the last attempt failed")
    delivered_at: datetime | None = None


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
    stored_bytes: int = Field(
        description="bytes counted against max_stored_bytes: stored_module_bytes + stored_files_bytes + stored_async_bytes"
    )
    stored_module_bytes: int = Field(description="bytes of the kept versions of the tenant's modules")
    stored_files_bytes: int = Field(default=0, description="bytes of the file archives of the tenant's functions")
    stored_async_bytes: int = Field(description="bytes of stored async inputs (until they run) and outputs (until they expire)")
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


class ClusterOut(BaseModel):
    """This node in the cluster, as the `nodes` table shows it (alive: a heartbeat younger than
    TENSORWASM_NODE_DEAD_AFTER_S)."""

    node: str = Field(description="the node that answered (TENSORWASM_NODE_ID)")
    heartbeat_age_s: float | None = Field(description="seconds since this node's last heartbeat; null: it has written none")
    heartbeat: HeartbeatState = Field(description="ok | stale (older than TENSORWASM_NODE_DEAD_AFTER_S: other nodes take it for dead) | missing")
    nodes_alive: int = Field(description="nodes whose heartbeat is recent, this one included")


class Ready(Health):
    devices: list[DeviceOut] = Field(description="this node's devices (one on a CPU node)")
    cluster: ClusterOut | None = Field(default=None, description="this node and the nodes it sees alive; null when the database is out of reach")


class NodeOut(BaseModel):
    id: str = Field(description="TENSORWASM_NODE_ID of the node")
    host: str
    started_at: datetime = Field(description="its last (re)start")
    last_seen: datetime = Field(description="its last heartbeat")
    alive: bool = Field(description="last_seen within TENSORWASM_NODE_DEAD_AFTER_S of the answering node's clock")


class ErrorBody(BaseModel):
    code: str = Field(description="snake_case error code")
    message: str = Field(description="what went wrong and what to do")
    exit_code: int | None = Field(default=None, description="invoke errors: the guest's exit code, where known")
    stderr_tail: str | None = Field(default=None, description="invoke errors: the end of the guest's stderr")


class ErrorEnvelope(BaseModel):
    """Every error the API answers."""

    error: ErrorBody


class LogLineOut(BaseModel):
    invocation_id: str
    version: int | None = Field(description="the function's version the call ran")
    time: datetime = Field(description="when the call ended")
    line: str = Field(description="one line the guest wrote to stderr (its call's last 64 KiB are kept)")


class LogPage(BaseModel):
    lines: list[LogLineOut] = Field(description="oldest first")


class CallbackSecretOut(BaseModel):
    secret: str = Field(description="the key of the HMAC-SHA256 in X-TensorWasm-Signature")
    created_at: datetime
