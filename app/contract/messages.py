"""Every message between fronts, the supervisor and workers, defined once.

Two channels, each a tagged union of msgspec Structs encoded as MessagePack:

- worker frames (`WorkerMessage`, tag `op`): the supervisor <-> worker control pipe (ready, bind,
  ping, exit) and the front <-> worker unix socket (run, then zero or more chunk frames and one
  result). A frame is `u32 header_len | u32 body_len | header | body` (app/contract/frames.py);
  bodies (stdin, stdout + stderr tail, chunks) stay raw bytes, never inside the header.
- node messages (`NodeMessage`, tag `t`): front <-> supervisor over the supervisor's unix socket:
  leases of cold calls (and their withdrawal), releases, rate checks, each tenant's routes, grow hints, failed workers,
  views (usage, workers, readiness, metrics) and cache invalidations broadcast to every front.

A warm call on a node of several fronts (the tenant has routed workers) sends the supervisor
nothing; its admission is one step in the shared table (app/node/admission.py):

    front                            admission table               worker
      |--- admit: rate, in flight, ----->|
      |    the shortest queue            |
      |--- Run(route token, start_by), stdin ------------------------>|  FIFO by start_by, run
      |<-- Chunk* (streamed), Result, stdout + stderr tail -----------|
      |--- leave: counts given back ---->|

A cold call (no routed worker yet) takes a lease; the binding pushes the tenant's routes:

    front                            supervisor                    worker
      |--- LeaseRequest(req) ------------>|  admit, bind a worker
      |<-- Routes(tenant) ----------------|  (to every front)
      |<-- Granted(req, token) -----------|  (or Refusal(req))
      |--- Run(lease=token), stdin ---------------------------------->|  check the token, run
      |<-- Chunk* (streamed), Result, stdout + stderr tail -----------|
      |--- ReleaseLease(outcome) -------->|  the worker idle again, or replaced

Neither side ever unpickles what the other wrote: decoding validates types against these
definitions, so a compromised worker cannot run code in a front or the supervisor.

Cost per encode + decode, best of 5 x 20k, on the 2-core dev box (`python -m app.bench.contract`;
two runs, the box shared with other work):

| message | msgspec MessagePack Struct | json.dumps/loads of a dict | pydantic model_dump_json / model_validate_json |
| --- | --- | --- | --- |
| run header | 2.3 – 2.5 µs | 9.4 – 13.6 µs | 5.9 – 9.4 µs |
| lease request | 1.3 – 1.4 µs | 7.9 – 8.7 µs | 7.4 – 8.9 µs |

msgspec also validates every field on decode (json.loads does not), and carries bytes natively
(the lease MAC) where JSON needs hex.
"""

from __future__ import annotations

import hmac
from enum import StrEnum
from typing import Any

import msgspec


class RunStatus(StrEnum):
    """How a guest run ended, as the worker reports it."""

    OK = "ok"
    EXIT = "exit"  # non-zero exit code
    TRAP = "trap"
    ERROR = "error"  # instantiation failed (imports, memory limits)
    OUTPUT_LIMIT = "output_limit"
    TIMEOUT = "timeout"
    DEVICE_ERROR = "device_error"
    ARTIFACT_ERROR = "artifact_error"
    CANCELLED = "cancelled"  # the caller went away and the worker stopped the guest


class Outcome(StrEnum):
    """What became of a lease's call; decides what the supervisor does with the worker."""

    OK = "ok"  # the worker answered: idle again
    UNUSED = "unused"  # granted to a caller that had gone away: idle again, nothing ran
    DEVICE_ERROR = "device_error"  # answered, its device context is poisoned: replace
    LOST = "lost"  # died or broke the protocol: replace
    HARD_TIMEOUT = "hard_timeout"  # past the hard deadline: kill and replace
    CANCELLED = "cancelled"  # the caller went away mid-call; the reply is orphaned: replace


# -- worker frames ----------------------------------------------------------------------------------
class _W(msgspec.Struct, tag_field="op", omit_defaults=True, forbid_unknown_fields=True):
    pass


class DeviceInfo(msgspec.Struct, omit_defaults=True):
    name: str = ""
    compute_capability: str | None = None
    total_memory_bytes: int = 0
    pci_bus_id: str | None = None
    cuda_visible_devices: str | None = None  # what the node pinned the worker to (None: not pinned)


class Ready(_W, tag="ready"):
    """Worker -> supervisor, once, when its runtime is loaded."""

    pid: int
    backend: str
    device: DeviceInfo


class StartRefusal(_W, tag="start_refused"):
    """Worker -> supervisor, instead of Ready: the driver refused its device context (the
    device's context ceiling); the worker exits."""

    error: str


class Bind(_W, tag="bind"):
    """Supervisor -> worker: serve this tenant from now on (and accept runs leased for it)."""

    tenant_id: str
    tenant: str
    gpu_memory_bytes: int
    kernels: dict[str, str] | None = None
    worker_id: str = ""
    secret: bytes = b""  # the node's lease-token key (empty: runs come only over the pipe)
    # the node's GPU share table and this worker's row in it (none: launches are never held)
    share_path: str = ""
    share_row: int = -1
    device: int = 0
    gpu_weight: int = 1
    # make the backend's deferred set-up (cuBLAS's handle) once idle: the tenant's calls have
    # used it. Otherwise a bound worker leaves it to the first call that needs it: each handle
    # made is driver time that other workers' starts wait for.
    warm: bool = False


class Done(_W, tag="ok"):
    pass


class Ping(_W, tag="ping"):
    pass


class Pong(_W, tag="pong"):
    time: float


class Exit(_W, tag="exit"):
    pass


class LeaseToken(msgspec.Struct, frozen=True):
    """Proof that the supervisor leased this worker for this tenant, for one run:
    HMAC(secret, id|worker|tenant). A route's token (lease_id "") admits any number of runs of
    the tenant: the worker is bound to it and its fronts send calls straight to it."""

    lease_id: str
    tenant_id: str
    mac: bytes


class Run(_W, tag="run"):
    """Front (or the in-process api) -> worker; body = stdin."""

    invocation_id: str
    function: str
    sha256: str
    env: dict[str, str]
    timeout_ms: int
    wasm_memory_bytes: int
    stdout_limit: int
    stderr_limit: int
    kernels: dict[str, str] | None = None  # only when the worker holds another version
    kernels_version: str = ""
    traceparent: str | None = None
    stream: bool = False  # stdout as Chunk frames while the guest runs, then the Result
    lease: LeaseToken | None = None  # required on a front's socket
    start_by: float = 0.0  # CLOCK_MONOTONIC: a run still queued then is refused (late), not started
    args: list[str] = msgspec.field(default_factory=list)  # argv after the function's name
    files: str = ""  # sha256 of the function's unpacked file bundle, the guest's `/` ("": none)
    scratch_bytes: int = 0  # > 0: the guest gets a writable copy of the files, capped at this size


class HostCounts(msgspec.Struct, omit_defaults=True):
    launches: int = 0
    compile_hits: int = 0
    compile_misses: int = 0
    gpu_peak_bytes: int = 0
    device_error: bool = False
    device_error_message: str | None = None


class Chunk(_W, tag="chunk"):
    """Worker -> front while a guest runs (streamed stdout); body = the bytes."""


class Result(_W, tag="result"):
    """Worker -> caller, last frame of a run; body = stdout then the stderr tail."""

    status: RunStatus
    stdout_len: int
    exit_code: int | None = None
    error: str | None = None
    duration_ms: float = 0.0
    host: HostCounts = msgspec.field(default_factory=HostCounts)
    spans: list[dict[str, Any]] | None = None


class RefuseReason(StrEnum):
    TOKEN = "token"  # bad or spent lease token, another tenant
    KERNELS = "kernels"  # the worker holds another kernel set: send the sources
    LATE = "late"  # queued past its start_by


class Refused(_W, tag="refused"):
    """Worker -> front: the run was not started."""

    error: str
    reason: RefuseReason = RefuseReason.TOKEN


class Failed(_W, tag="error"):
    error: str


WorkerMessage = Ready | StartRefusal | Bind | Done | Ping | Pong | Exit | Run | Chunk | Result | Refused | Failed


# -- node messages (front <-> supervisor) ----------------------------------------------------------
class _N(msgspec.Struct, tag_field="t", omit_defaults=True, forbid_unknown_fields=True):
    pass


class Quota(msgspec.Struct, frozen=True):
    """A tenant's quota: the one shape of it the API, the fronts, the supervisor and the
    scheduler share (app/services/principal.py builds it from a tenant's row, with its bounds)."""

    gpu_memory_bytes: int
    max_concurrency: int
    requests_per_second: float
    max_functions: int
    max_module_bytes: int
    wasm_memory_bytes: int
    timeout_ms: int
    max_queued: int
    # the columns' defaults: a quota built from a tenant's row always carries the row's values
    max_stored_bytes: int = 1024**3
    max_files_bytes: int = 64 * 1024**2
    scratch_bytes: int = 16 * 1024**2
    max_secrets: int = 100
    max_secret_bytes: int = 1024**2
    gpu_weight: int = 1  # the tenant's share of a device's time against other tenants' (app/gpu/share.py)


class Principal(msgspec.Struct, frozen=True):
    """An authenticated tenant, as every process of a node sees it."""

    id: str
    name: str
    quota: Quota


class Hello(_N, tag="hello"):
    front: int
    pid: int


class Route(msgspec.Struct, frozen=True):
    """One worker bound to a tenant, as fronts reach it: its socket, its slot in the node's
    admission table (its queue length), its stats page (what it is running) and its token."""

    worker_id: str
    socket: str
    slot: int
    page: str
    token: LeaseToken


class Routes(_N, tag="routes"):
    """Supervisor -> fronts: the tenant's workers now (empty: none; its calls ask for a lease)."""

    tenant_id: str
    workers: list[Route]


class Grow(_N, tag="grow"):
    """Front -> supervisor, not answered: the tenant's calls queue at every one of its workers."""

    principal: Principal


class WorkerFailed(_N, tag="worker_failed"):
    """Front -> supervisor: a worker reached by a route failed a call (`outcome`): replace it."""

    worker_id: str
    outcome: Outcome


class LeaseRequest(_N, tag="lease"):
    req: int
    principal: Principal
    hard_timeout_s: float
    check_rate: bool = True
    traceparent: str | None = None


class Granted(_N, tag="granted"):
    """Supervisor -> front: the worker is the call's until the front's `ReleaseLease`."""

    req: int
    lease_id: str
    worker_id: str
    socket: str
    token: LeaseToken
    kernels_version: str  # what the worker holds now: the front sends sources when it differs


class RefusalKind(StrEnum):
    REJECTED = "rejected"
    NO_CAPACITY = "no_capacity"


class Refusal(_N, tag="refusal"):
    req: int
    kind: RefusalKind
    message: str
    reason: str = ""
    retry_after: int = 1


class WithdrawLease(_N, tag="withdraw"):
    """Front -> supervisor: lease request `req` is no longer wanted (its call ended before the
    grant): dropped from the tenant's queue, so it takes no worker a waiting call could have. A
    grant already on its way is handed back unused."""

    req: int


class ReleaseLease(_N, tag="release"):
    lease_id: str
    outcome: Outcome
    kernels_version: str = ""  # what the worker holds after the call


class CompileSlot(_N, tag="compile_slot"):
    """Front -> supervisor: may this tenant compile now? Answered `SlotGranted` when it may
    (the node's fair compile limiter: TENSORWASM_COMPILE_CONCURRENCY, one per tenant)."""

    req: int
    tenant_id: str


class SlotGranted(_N, tag="slot_granted"):
    req: int
    tenant_id: str


class CompileDone(_N, tag="compile_done"):
    """Front -> supervisor: the tenant's compile ended; its slot is free."""

    tenant_id: str


class RateCheck(_N, tag="rate"):
    req: int
    principal: Principal


class RateOk(_N, tag="rate_ok"):
    req: int


class ViewKind(StrEnum):
    USAGE = "usage"
    WORKERS = "workers"
    READY = "ready"
    METRICS = "metrics"
    QUEUE_DEPTH = "queue_depth"


class View(_N, tag="view"):
    req: int
    kind: ViewKind
    tenant_id: str = ""


class Usage(msgspec.Struct):
    running: int
    queued: int
    workers: int
    gpu_bytes_in_use: int


class WorkerInfo(msgspec.Struct):
    id: str
    pid: int | None
    state: str
    backend: str
    tenant_id: str | None
    tenant: str | None
    gpu_bytes_in_use: int
    gpu_bytes_cap: int
    invocations: int
    started_at: str  # ISO 8601 with zone
    compute_capability: str | None = None
    device_name: str = ""
    device: int = 0  # the node's device index it is pinned to


class DeviceView(msgspec.Struct):
    index: int
    name: str
    status: str  # app.scheduler.devices.DeviceStatus
    contexts: int
    ceiling: int
    configured_ceiling: int
    learned_ceiling: int
    committed_bytes: int
    budget_bytes: int
    start_failures: int
    backoff_s: float


class Readiness(msgspec.Struct):
    workers: bool  # a worker is ready
    devices_usable: bool  # some device is not backing off after failed starts
    devices: list[DeviceView]
    # none ready and none kept (warm_spares 0): a call starts one, so the node serves all the same
    on_demand: bool = False


class ViewReply(_N, tag="view_reply"):
    req: int
    usage: Usage | None = None
    workers: list[WorkerInfo] | None = None
    readiness: Readiness | None = None
    metrics: bytes = b""  # the supervisor's Prometheus text (families disjoint from the fronts')
    queue_depth: int = 0


class ChangeKind(StrEnum):
    TENANT = "tenant"  # disabled, deleted, quota: drop every cache of it, retire its workers
    FUNCTION = "function"  # deployed or deleted
    KERNELS = "kernels"
    KEYS = "keys"  # a key revoked: drop cached authentications
    QUEUED = "queued"  # async work submitted: the front that drains the queue looks now
    CANCEL = "cancel"  # an async invocation (`name`: its id) to stop if it runs on that front
    FLUSH = "flush"  # write your batched invocation records now
    APPLIED = "applied"  # front -> supervisor: the change carrying `token` is applied here


class Changed(_N, tag="changed"):
    """Front -> supervisor after an admin change; supervisor -> every other front.

    A front that sends `req` is answered `ViewReply(req)` once every other front has applied the
    change (or after 2 s), so an admin call returns only when no front still serves what it
    changed. The supervisor forwards such a change with a `token`, answered by `APPLIED`."""

    kind: ChangeKind
    tenant_id: str = ""
    name: str = ""
    req: int = 0
    token: str = ""


NodeMessage = (
    Hello | LeaseRequest | WithdrawLease | Granted | Refusal | ReleaseLease | CompileSlot | SlotGranted | CompileDone | RateCheck | RateOk
    | View | ViewReply | Changed | Routes | Grow | WorkerFailed
)


worker_encoder = msgspec.msgpack.Encoder()
worker_decoder: msgspec.msgpack.Decoder[WorkerMessage] = msgspec.msgpack.Decoder(WorkerMessage)
node_encoder = msgspec.msgpack.Encoder()
node_decoder: msgspec.msgpack.Decoder[NodeMessage] = msgspec.msgpack.Decoder(NodeMessage)


def lease_mac(secret: bytes, lease_id: str, worker_id: str, tenant_id: str) -> bytes:
    """The token a worker checks on a front's run, without asking the supervisor."""
    return hmac.digest(secret, f"{lease_id}|{worker_id}|{tenant_id}".encode(), "sha256")
