"""What an authenticated tenant request carries through the platform."""

from __future__ import annotations

from dataclasses import dataclass

from app.db.models import Tenant

QUOTA_FIELDS = (
    "gpu_memory_bytes",
    "max_concurrency",
    "requests_per_second",
    "max_functions",
    "max_module_bytes",
    "wasm_memory_bytes",
    "timeout_ms",
    "max_queued",
)

# Bounds of the quota fields. Each maximum fits its column (timeout_ms, max_concurrency and
# max_functions are 32-bit integers; the byte counts 64-bit) and is generous for one tenant.
GIB = 1024**3
QUOTA_BOUNDS: dict[str, int | float] = {
    "gpu_memory_bytes": 1024 * GIB,  # 1 TiB: more than any single device holds
    "max_concurrency": 1024,
    "requests_per_second": 1_000_000.0,
    "max_functions": 100_000,
    "max_module_bytes": 256 * 1024**2,  # 256 MiB: a module is held in memory while compiled
    "wasm_memory_bytes": 4 * GIB,  # the wasm32 address space
    "timeout_ms": 3_600_000,  # one hour
    "max_queued": 1_000_000,  # rows waiting in the shared database
}
QUOTA_MINIMUMS: dict[str, int | float] = {
    "gpu_memory_bytes": 0,
    "max_concurrency": 1,
    "requests_per_second": 0.001,  # slower would make retry times overflow
    "max_functions": 0,
    "max_module_bytes": 8,
    "wasm_memory_bytes": 65536,  # one page
    "timeout_ms": 1,
    "max_queued": 0,
}


@dataclass(frozen=True)
class TenantQuota:
    gpu_memory_bytes: int
    max_concurrency: int
    requests_per_second: float
    max_functions: int
    max_module_bytes: int
    wasm_memory_bytes: int
    timeout_ms: int
    max_queued: int

    @classmethod
    def of(cls, tenant: Tenant) -> TenantQuota:
        return cls(**{f: getattr(tenant, f) for f in QUOTA_FIELDS})

    def as_dict(self) -> dict[str, int | float]:
        return {f: getattr(self, f) for f in QUOTA_FIELDS}


@dataclass(frozen=True)
class TenantPrincipal:
    id: str
    name: str
    quota: TenantQuota

    @classmethod
    def of(cls, tenant: Tenant) -> TenantPrincipal:
        return cls(id=tenant.id, name=tenant.name, quota=TenantQuota.of(tenant))
