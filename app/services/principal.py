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
    def of(cls, tenant: Tenant) -> "TenantQuota":
        return cls(**{f: getattr(tenant, f) for f in QUOTA_FIELDS})

    def as_dict(self) -> dict[str, int | float]:
        return {f: getattr(self, f) for f in QUOTA_FIELDS}


@dataclass(frozen=True)
class TenantPrincipal:
    id: str
    name: str
    quota: TenantQuota

    @classmethod
    def of(cls, tenant: Tenant) -> "TenantPrincipal":
        return cls(id=tenant.id, name=tenant.name, quota=TenantQuota.of(tenant))
