"""All configuration, read once from ``TENSORWASM_*`` environment variables."""

from __future__ import annotations

import os
import secrets
import stat
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TENSORWASM_", extra="ignore")

    # --- process and storage -------------------------------------------------------------
    data_dir: Path = Path("./.tensorwasm")
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; default: a SQLite file in the data dir"
    )
    admin_token: str | None = None
    host: str = "127.0.0.1"
    # HTTP front processes serving the port; above 1, the scheduler runs in a supervisor
    # process of its own and calls go from a front straight to its leased worker.
    processes: int = Field(default_factory=lambda: min(os.cpu_count() or 1, 8), ge=1, le=256)
    port: int = 8080
    log_level: str = "info"
    log_format: Literal["auto", "json", "console"] = "auto"
    metrics_token: str | None = None
    access_log: bool = False
    otlp_endpoint: str | None = None

    # --- default quota of a new tenant -----------------------------------------------------
    default_gpu_memory_bytes: int = 256 * 1024 * 1024
    default_max_concurrency: int = 4
    default_requests_per_second: float = 100.0
    default_max_functions: int = 50
    default_max_module_bytes: int = 16 * 1024 * 1024
    default_wasm_memory_bytes: int = 256 * 1024 * 1024
    default_timeout_ms: int = 10_000

    # --- execution -------------------------------------------------------------------------
    backend: Literal["auto", "cpu", "cuda"] = "auto"
    # Tenant buffers in CUDA managed memory (default) or plain device memory (faster copies).
    gpu_memory: Literal["managed", "device"] = "managed"
    # Guest linear memory a CUDA worker may page-lock for direct copies (2 MiB chunks, kept for
    # the worker's life; 0 = every copy goes through the driver's pageable staging path).
    pinned_guest_memory_bytes: int = 256 * 1024 * 1024
    max_workers: int = 4
    warm_spares: int = 1
    # Worker slots only a tenant with nothing running may take: a tenant with calls running holds
    # at most max_workers - reserved_workers, so another tenant's call starts at once in a flood.
    reserved_workers: int = Field(default=1, ge=0)
    queue_limit: int = 32
    queue_wait_ms: int = 1000
    hard_timeout_grace_ms: int = 1000
    worker_start_timeout_s: float = 60.0
    # Fork workers from a process that already imported the runtime (no CUDA call made there);
    # false: a fresh interpreter per worker.
    fork_server: bool = True
    stdout_limit_bytes: int = 16 * 1024 * 1024
    stderr_tail_bytes: int = 64 * 1024
    max_request_bytes: int = 32 * 1024 * 1024
    epoch_tick_ms: int = 5
    # Auth and function metadata are cached per node; other nodes see revocations after this.
    cache_ttl_s: float = 2.0
    # Entries used within this many seconds are re-read in the background before they expire.
    cache_keep_s: float = 300.0
    # Most functions the node keeps fresh in the background, and most names remembered as
    # missing (for cache_ttl_s each); beyond either, the least recently used are forgotten.
    function_cache_size: int = Field(default=10_000, ge=1)
    # Bytes of device memory one CUDA context costs before any buffer (measured: ~529 MiB).
    context_overhead_bytes: int = 600 * 1024 * 1024
    # Device memory the scheduler may hand out; 0 = the device total as reported at start.
    device_memory_bytes: int = 0
    # Max buffers / modules one instance may hold (ABI QUOTA_EXCEEDED beyond).
    max_buffers_per_instance: int = 1024
    max_modules_per_instance: int = 64

    # --- invocation records ----------------------------------------------------------------
    record_flush_interval_s: float = 0.2
    record_batch_size: int = 500

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'tensorwasm.db').resolve()}"

    @property
    def cache_dir(self) -> Path:
        return self.data_dir / "cache"

    @property
    def kernels_dir(self) -> Path:
        return REPO_ROOT / "kernels"

    def ensure_data_dir(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

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
