"""All configuration, read once from ``TENSORWASM_*`` environment variables."""

from __future__ import annotations

import os
import secrets
import stat
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TENSORWASM_", extra="ignore")

    # --- process and storage -------------------------------------------------------------
    data_dir: Path = Path("./.tensorwasm")
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; default: a SQLite file in the data dir"
    )
    admin_token: str | None = None
    # The key sealing tenants' secrets in the database (32 bytes, as 64 hex digits or base64).
    # Unset: one is generated into the data dir (`secrets_key`, 0600) on first use. Every node
    # of a cluster must have the same: a node with another cannot read the secrets.
    secrets_key: SecretStr | None = None
    host: str = "127.0.0.1"
    # HTTP front processes serving the port; above 1, the scheduler runs in a supervisor
    # process of its own and calls go from a front straight to its leased worker.
    processes: int = Field(default_factory=lambda: min(os.cpu_count() or 1, 8), ge=1, le=256)
    port: int = 8080
    log_level: str = "info"
    log_format: Literal["auto", "json", "console"] = "auto"
    # Without a metrics token, /metrics (every tenant's name is in its labels) answers callers
    # on loopback alone; others must send the admin token. true: it answers everyone.
    metrics_public: bool = False
    metrics_token: str | None = None
    # One log line per request (method, route template, status, duration, tenant); false: none.
    access_log: bool = True

    # --- the edge: each front's connections (app/api/edge.py, docs/operations.md) -----------
    # Open connections one front holds; past it the one longest waiting for a request head is
    # closed, or the new one refused (503) when all are in a request. Bounded by the process's
    # descriptor limit, which a front raises to its hard limit.
    max_connections: int = Field(default=10_000, ge=16)
    # A request's head (request line and headers) must arrive in full within this long of the
    # connection opening or of the previous response: 408 and close.
    head_timeout_s: float = Field(default=10.0, gt=0)
    # Bytes and fields of one request head: past either, 431 and close.
    max_head_bytes: int = Field(default=64 * 1024, ge=1024)
    max_headers: int = Field(default=100, ge=8)
    # An idle keep-alive connection is closed after this long without a request.
    keepalive_timeout_s: float = Field(default=5.0, gt=0)
    # After body_grace_s, a body still arriving must have averaged min_body_bytes_per_s (time the
    # front paused reading does not count): else 408 and close. 0: no minimum rate.
    body_grace_s: float = Field(default=10.0, gt=0)
    min_body_bytes_per_s: int = Field(default=1024, ge=0)
    # Failed authentications one client address (an IPv6 /64) may make per second on one front
    # (burst: auth_failure_burst); past it 429 with Retry-After and no lookup. 0: no limit.
    auth_failures_per_s: float = Field(default=5.0, ge=0)
    auth_failure_burst: int = Field(default=20, ge=1)
    otlp_endpoint: str | None = None

    # --- default quota of a new tenant -----------------------------------------------------
    default_gpu_memory_bytes: int = 256 * 1024 * 1024
    default_max_concurrency: int = 4
    default_requests_per_second: float = 100.0
    default_max_functions: int = 50
    default_max_module_bytes: int = 16 * 1024 * 1024
    default_wasm_memory_bytes: int = 256 * 1024 * 1024
    default_timeout_ms: int = 10_000
    default_max_queued: int = 1000
    # bytes of stored async inputs and outputs and of kept module versions (docs/operations.md)
    default_max_stored_bytes: int = 1024**3
    # bytes of a function's files, unpacked (PUT /v1/functions/{name}/files)
    default_max_files_bytes: int = 64 * 1024**2
    # bytes a call's writable copy of its files may hold (deploy's scratch=true)
    default_scratch_bytes: int = 16 * 1024**2
    # secrets a tenant may keep, and bytes of all their values (PUT /v1/secrets/{name})
    default_max_secrets: int = 100
    default_max_secret_bytes: int = 1024**2
    default_gpu_weight: int = 1

    # --- execution -------------------------------------------------------------------------
    backend: Literal["auto", "cpu", "cuda"] = "auto"
    # Tenant buffers in CUDA managed memory (default) or plain device memory (faster copies).
    gpu_memory: Literal["managed", "device"] = "managed"
    # Guest linear memory a CUDA worker may page-lock for direct copies (2 MiB chunks, kept for
    # the worker's life; 0 = every copy goes through the driver's pageable staging path).
    pinned_guest_memory_bytes: int = 256 * 1024 * 1024
    # Hardware work queues of a worker's context (CUDA_DEVICE_MAX_CONNECTIONS). A worker runs
    # everything on one stream, so one queue loses nothing; measured on an H200, contexts with one
    # are created 2.5x faster, end 2.8x faster and cost ~47 MiB less host memory than with the
    # driver's default of 8.
    cuda_max_connections: int = Field(default=1, ge=1, le=32)
    max_workers: int = 4
    warm_spares: int = 1
    # Spares per device kept at most, from the node's room or while new tenants arrive faster
    # than one start per start time (the node keeps about arrival rate x start time + 1);
    # warm_spares 0 keeps none.
    max_warm_spares: int = Field(default=32, ge=0)
    # Of the worker slots no tenant holds, the share kept as ready spares (per device, within
    # warm_spares..max_warm_spares): contexts come at the driver's pace, one after another, so
    # only spares made beforehand bind new tenants that arrive back to back. 65 free slots on one
    # GPU keep 32 (~18 GiB of an H200, given back to any tenant cap that needs it); 4 keep 2.
    spare_room_share: float = Field(default=0.5, ge=0.0, le=1.0)
    # Worker slots only a tenant with nothing running may take: a tenant with calls running holds
    # at most max_workers - reserved_workers, so another tenant's call starts at once in a flood.
    reserved_workers: int = Field(default=1, ge=0)
    queue_limit: int = 256  # waiting calls are cheap (a ticket and a timer each) and bounded by queue_wait_ms
    queue_wait_ms: int = 1000
    # A front's time between tenants: while a light tenant's call (admitted onto a free worker,
    # none of its calls queued) is in a front, the calls queued behind another at their workers go
    # on this many per pass of its event loop; 0: none ever waits.
    front_share_per_pass: int = Field(default=1, ge=0)
    # ... and for this long after a light tenant's last call in a front: its next call is given way
    # from its first step, before it is known to be light again
    front_share_linger_ms: int = Field(default=50, ge=0, le=60_000)
    # How long a front and a worker poll after a call's message instead of sleeping, so that at
    # low load the next message is read as it lands, not after a wake-up; each stops at the first
    # yield of its core to another process (app/node/spin.py). 0: never poll.
    spin_us: int = Field(default=300, ge=0, le=10_000)
    # tenants the node's shared admission table holds with calls in flight or a rate debt at once
    admission_tenants: int = Field(default=16384, ge=64, le=1_048_576)
    hard_timeout_grace_ms: int = 1000
    worker_start_timeout_s: float = 60.0
    # Fork workers from a process that already imported the runtime (no CUDA call made there);
    # false: a fresh interpreter per worker.
    fork_server: bool = True
    stdout_limit_bytes: int = 16 * 1024 * 1024
    stderr_tail_bytes: int = 64 * 1024
    max_request_bytes: int = 32 * 1024 * 1024
    # Request bodies (invoke, async submit, deploy, kernel upload) one tenant may hold in one front
    # at once, read or being read; past it 429. A tenant holding none may always send one body.
    max_tenant_body_bytes: int = Field(default=256 * 1024 * 1024, ge=0)
    # Bodies of JSON routes (admin and the like); refused with 413 before they are read.
    max_json_bytes: int = 1024 * 1024
    epoch_tick_ms: int = 5
    # Auth and function metadata are cached per node; other nodes see revocations after this.
    cache_ttl_s: float = 2.0
    # Entries used within this many seconds are re-read in the background before they expire.
    cache_keep_s: float = 300.0
    # Most functions the node keeps fresh in the background, and most names remembered as
    # missing (for cache_ttl_s each); beyond either, the least recently used are forgotten.
    function_cache_size: int = Field(default=10_000, ge=1)
    # Bytes of device memory one worker's CUDA context costs before any buffer, with the 4 MiB
    # staging block of a managed-memory worker (a context measured ~591 MiB on H100 and H200
    # hosts, CUDA 13).
    context_overhead_bytes: int = 600 * 1024 * 1024
    # Device memory the scheduler may hand out, per device; 0 = each device's total as reported.
    device_memory_bytes: int = 0
    # Contexts (workers) one device may hold; 0 = no configured limit, only the one learned when
    # the driver refuses a context (measured on an H200: the 101st with 8 hardware queues per
    # context; with one, the default here, 130 were created and none refused).
    max_contexts_per_device: int = Field(default=0, ge=0)
    # Workers starting at once on this node. The driver creates contexts one after another per
    # host, but a start is more than its context (its fork and setup, ~0.25 s): enough starts
    # must be under way to keep the driver busy, and no more, since each holds a worker slot
    # that a tenant's worker could use. On a full H200 (72 workers, 96 tenants) 4, 6 and 8 at
    # once all switched ~12 tenants a second, and 6 served 8 % more calls than 8
    # (docs/benchmarks.md); 4 left the driver no slack (a start ~0.34 s, its setup ~0.25).
    max_parallel_starts: int = Field(default=6, ge=1)
    # With every slot bound, the least recently used idle tenant's worker is retired ahead of need
    # (so a new tenant finds a spare) only once it has been idle this long: a tenant calling now
    # and then, one call at a time, is never idle by that measure, and keeps its warm context.
    retire_idle_after_s: float = Field(default=5.0, ge=0)
    # Files, directories and links one function's archive may hold (PUT .../files; 422 past it).
    max_files_entries: int = Field(default=10_000, ge=1, le=1_000_000)
    # A GPU's time by tenant weight (quota gpu_weight), whatever the number of a tenant's contexts:
    # a worker holds back launches while its tenant is above its share and another wants the device.
    gpu_share: bool = True
    # How long after its last kernels a tenant still counts as wanting the device: a tenant calling
    # back to back keeps its share through the gaps between its calls (its latency near alone),
    # while tenants over their share wait; 0 lends those gaps out (more throughput for the others).
    gpu_share_linger_ms: float = Field(default=20.0, ge=0, le=10_000)
    # Max buffers / modules one instance may hold (ABI QUOTA_EXCEEDED beyond).
    max_buffers_per_instance: int = 1024
    max_modules_per_instance: int = 64

    # --- async invocations and streaming ---------------------------------------------------
    # How long the stored output of an async invocation is kept after it ended (then 410).
    output_retention_s: float = 86_400.0
    # Every invocation's stderr tail is cleared after output_retention_s too; its record (status,
    # timings, error) is deleted after this long.
    record_retention_s: float = Field(default=30 * 86_400.0, gt=0)
    # An Idempotency-Key repeated within this window returns the same invocation.
    idempotency_window_s: float = 86_400.0
    # This node's name in `claimed_by`; default: derived from the host name and the data dir, so
    # a node restarted on the same data dir finds the work it was running when it died.
    node_id: str | None = None
    # Async invocations this node runs at once (each still under its tenant's quotas); 0 = max_workers.
    async_concurrency: int = 0
    # A claimed invocation's lease; the running node renews it every third of this. A lease
    # expired on a shared database means its node died: the invocation ends `interrupted`.
    queue_lease_s: float = 15.0
    # How often a node looks for queued work submitted through other nodes.
    queue_poll_s: float = 0.25
    # How often outputs past the retention and expired leases are swept.
    queue_sweep_s: float = 60.0
    # How often a node writes its heartbeat (the `nodes` table) and looks for dead nodes' work.
    node_heartbeat_s: float = Field(default=1.0, gt=0)
    # A node not seen for this long is dead: the async work it held is queued again (or ends
    # `interrupted` once its attempts are spent). Above a few heartbeats, so a busy database or a
    # collector pause is not taken for a death; nodes' clocks must agree well within it (NTP).
    node_dead_after_s: float = Field(default=5.0, gt=0)
    # Versions kept of each function, the active (latest) one included; older ones are deleted at
    # the deploy that passes this count, with their compiled artifacts once no version of any
    # tenant uses them.
    kept_versions: int = Field(default=5, ge=1, le=1000)

    # --- compiles of tenant code (Wasm modules, CUDA sources), each in a sandbox process ---
    # Address space one compile process may map, its interpreter and compiler included (~200
    # MiB before any work); a compile that needs more is refused with 422.
    compile_memory_bytes: int = Field(default=2 * 1024**3, ge=256 * 1024**2)
    # Wall-clock limit of one compile; the process is killed past it and the upload refused (422).
    compile_timeout_s: float = Field(default=30.0, gt=0)
    # Compiles at once on this node, at most one per tenant (a tenant's others wait their turn):
    # another tenant's deploy waits for at most one compile to finish.
    compile_concurrency: int = Field(default=2, ge=1)

    # --- invocation records ----------------------------------------------------------------
    record_flush_interval_s: float = 0.2
    record_batch_size: int = 500

    # --- function logs (GET /v1/functions/{name}/logs) -------------------------------------
    # Bytes of stderr (UTF-8) kept per tenant, every function together; past it the lines of its
    # oldest calls are deleted first. 0: no logs kept.
    log_bytes_per_tenant: int = Field(default=4 * 1024**2, ge=0, le=1024**3)
    # How often a `logs?follow=1` stream asks the database for lines past its last (one indexed query).
    log_follow_poll_s: float = Field(default=0.25, gt=0, le=5)

    # --- callbacks of async invocations (X-Callback-Url) -----------------------------------
    # Accept callback URLs whose host is (or resolves to) a loopback, private, link-local or
    # otherwise non-public address. Off: refused at the submit (422), so a tenant cannot make
    # the node reach its own network.
    callback_allow_private: bool = False
    # One POST's time limit; past it the attempt failed.
    callback_timeout_s: float = Field(default=10.0, gt=0, le=120)
    # Retries go on for this long after the first attempt, then the callback is `failed`.
    callback_retry_s: float = Field(default=3600.0, ge=0, le=7 * 86_400)
    # The wait before the first retry; doubled at each retry up to callback_backoff_max_s.
    callback_backoff_s: float = Field(default=1.0, gt=0)
    callback_backoff_max_s: float = Field(default=300.0, gt=0)
    # How often a node looks for callbacks due (invocations ended on other nodes, retries).
    callback_poll_s: float = Field(default=1.0, gt=0)
    # Callbacks one node sends at once.
    callback_concurrency: int = Field(default=16, ge=1, le=1024)

    @model_validator(mode="after")
    def _default_quota_within_bounds(self) -> Settings:
        # a default outside the bounds would make every new tenant's quota unanswerable
        from app.services.principal import QUOTA_BOUNDS, QUOTA_MINIMUMS

        for field, high in QUOTA_BOUNDS.items():  # every quota field has a bound
            value, low = getattr(self, f"default_{field}"), QUOTA_MINIMUMS[field]
            if not low <= value <= high:
                raise ValueError(f"TENSORWASM_DEFAULT_{field.upper()} must be between {low} and {high}, got {value}")
        return self

    @model_validator(mode="after")
    def _dead_after_heartbeats(self) -> Settings:
        if self.node_dead_after_s < 2 * self.node_heartbeat_s:
            raise ValueError(
                f"TENSORWASM_NODE_DEAD_AFTER_S ({self.node_dead_after_s:g}) must be at least twice "
                f"TENSORWASM_NODE_HEARTBEAT_S ({self.node_heartbeat_s:g}): one late heartbeat is not a death"
            )
        return self

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'tensorwasm.db').resolve()}"

    @property
    def resolved_node_id(self) -> str:
        if self.node_id:
            return self.node_id
        import hashlib
        import socket

        digest = hashlib.sha256(str(self.data_dir.resolve()).encode()).hexdigest()[:12]
        return f"{socket.gethostname()[:40]}-{digest}"

    @property
    def cache_dir(self) -> Path:
        return self.data_dir / "cache"

    def ensure_data_dir(self) -> None:
        """Create the data dir, and tighten it at every start: the dir and its cache 0700, every
        file of ours in them (database and its journals, admin token, compiled modules) 0600, also
        when they were made earlier with wider modes. Only the owner reads tenants' modules and
        keys. Other files an operator keeps there are left alone."""
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for d in (self.data_dir, self.cache_dir):
            os.chmod(d, 0o700)
            for entry in os.scandir(d):
                ours = d == self.cache_dir or entry.name == "admin_token" or entry.name.startswith("tensorwasm.db")
                if ours and entry.is_file(follow_symlinks=False) and stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode) != 0o600:
                    os.chmod(entry.path, 0o600)
        if not self.database_url:
            # create the SQLite file 0600 ourselves: SQLite gives its WAL and shm files the
            # database file's mode, and would otherwise create it with the umask's
            os.close(os.open(self.data_dir / "tensorwasm.db", os.O_WRONLY | os.O_CREAT, 0o600))

    def ensure_admin_token(self) -> tuple[str, bool]:
        """Return the admin token, generating and persisting one (0600) on first start.

        The boolean says whether it was generated just now, so the caller prints it once.
        """
        if self.admin_token:
            return self.admin_token, False
        self.ensure_data_dir()
        path = self.data_dir / "admin_token"
        if path.exists():
            self.admin_token = path.read_text().strip()
            return self.admin_token, False
        token = "twadmin_" + secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        self.admin_token = token
        return token, True


@lru_cache
def get_settings() -> Settings:
    return Settings()
