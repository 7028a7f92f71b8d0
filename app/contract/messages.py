"""Every message between fronts, the supervisor and workers, defined once.

Two channels, each a tagged union of msgspec Structs encoded as MessagePack:

- worker frames (`WorkerMessage`, tag `op`): the supervisor <-> worker control pipe (ready, bind,
  ping, exit) and the front <-> worker unix socket (run, then zero or more chunk frames and one
  result). A frame is `u32 header_len | u32 body_len | header | body` (app/contract/frames.py);
  bodies (stdin, stdout + stderr tail, chunks) stay raw bytes, never inside the header.
- node messages (`NodeMessage`, tag `t`): front <-> supervisor over the supervisor's unix socket:
  leases, releases, rate checks, views (usage, workers, readiness, metrics) and cache
  invalidations broadcast to every front.

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


class Done(_W, tag="ok"):
    pass


class Ping(_W, tag="ping"):
    pass


class Pong(_W, tag="pong"):
    time: float


class Exit(_W, tag="exit"):
    pass


class LeaseToken(msgspec.Struct, frozen=True):
    """Proof that the supervisor leased this worker for this tenant, for at most `runs` runs:
    HMAC(secret, id|worker|tenant|runs)."""

    lease_id: str
    tenant_id: str
    mac: bytes
    runs: int = 1


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


class Refused(_W, tag="refused"):
    """Worker -> front: the run was not started (bad lease token, another tenant)."""

    error: str


class Failed(_W, tag="error"):
    error: str


WorkerMessage = Ready | StartRefusal | Bind | Done | Ping | Pong | Exit | Run | Chunk | Result | Refused | Failed


# -- node messages (front <-> supervisor) ----------------------------------------------------------
class _N(msgspec.Struct, tag_field="t", omit_defaults=True, forbid_unknown_fields=True):
    pass


class Quota(msgspec.Struct, frozen=True):
    gpu_memory_bytes: int
    max_concurrency: int
    requests_per_second: float
    max_functions: int
    max_module_bytes: int
    wasm_memory_bytes: int
    timeout_ms: int
    max_queued: int


class Principal(msgspec.Struct, frozen=True):
    id: str
    name: str
    quota: Quota


class Hello(_N, tag="hello"):
    front: int
    pid: int


class LeaseRequest(_N, tag="lease"):
    req: int
    principal: Principal
    hard_timeout_s: float
    check_rate: bool = True
    traceparent: str | None = None


class Granted(_N, tag="granted"):
    """Supervisor -> front. With `hold_s` > 0 the front may keep the lease for more calls of the
    tenant (their rate already taken) for `hold_s` after the grant, until it releases it or is
    told to (`Recall`). With `handoffs` > 0 the front may pass the lease, as a call ends, to up to
    that many calls of the tenant that wait in it for a lease (`Handoff`), until recalled.
    `token.runs` counts them all: the grant's call, the paid runs, the handoffs."""

    req: int
    lease_id: str
    worker_id: str
    socket: str
    token: LeaseToken
    kernels_version: str  # what the worker holds now: the front sends sources when it differs
    hold_s: float = 0.0
    handoffs: int = 0


class RefusalKind(StrEnum):
    REJECTED = "rejected"
    NO_CAPACITY = "no_capacity"


class Refusal(_N, tag="refusal"):
    req: int
    kind: RefusalKind
    message: str
    reason: str = ""
    retry_after: int = 1


class ReleaseLease(_N, tag="release"):
    lease_id: str
    outcome: Outcome
    kernels_version: str = ""  # what the worker holds after the call
    runs: int = 1  # calls the lease carried (a held lease: more than one)
    unused: int = 0  # runs granted and paid for but not made: given back to the tenant's rate


class Queued(_N, tag="queued"):
    """Supervisor -> front, with handoffs on: lease request `req` was admitted (rate, queue limit)
    and waits for a worker. Only such a request may be handed a lease by its front (`Handoff`): one
    the rate refused must never run, and its refusal may still be on the way."""

    req: int


class Handoff(_N, tag="handoff"):
    """Front -> supervisor: the lease's call ended cleanly and the front passed the lease to its
    own request `req` of the same tenant, which the supervisor said was `Queued`, whose call runs
    on it now (hard timeout `hard_timeout_s`). The request leaves the supervisor's queue; the slot
    goes with the lease. Sent before the run, so the supervisor's deadline covers it."""

    lease_id: str
    req: int
    hard_timeout_s: float


class Recall(_N, tag="recall"):
    """Supervisor -> front: a call waits that these held leases may serve. Release each at once
    when idle, after its call when one runs; start no further call on them."""

    lease_ids: list[str]


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
    Hello | LeaseRequest | Granted | Queued | Refusal | ReleaseLease | Handoff | Recall | CompileSlot | SlotGranted | CompileDone
    | RateCheck | RateOk | View | ViewReply | Changed
)


worker_encoder = msgspec.msgpack.Encoder()
worker_decoder: msgspec.msgpack.Decoder[WorkerMessage] = msgspec.msgpack.Decoder(WorkerMessage)
node_encoder = msgspec.msgpack.Encoder()
node_decoder: msgspec.msgpack.Decoder[NodeMessage] = msgspec.msgpack.Decoder(NodeMessage)


def lease_mac(secret: bytes, lease_id: str, worker_id: str, tenant_id: str, runs: int = 1) -> bytes:
    """The token a worker checks on a front's run, without asking the supervisor."""
    return hmac.digest(secret, f"{lease_id}|{worker_id}|{tenant_id}|{runs}".encode(), "sha256")
