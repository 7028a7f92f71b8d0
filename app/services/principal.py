"""What an authenticated tenant request carries through the platform: the contract's `Principal`
and `Quota` (app/contract/messages.py, one shape for the API, the fronts, the supervisor and the
scheduler), built from a tenant's row, and the bounds of the quota's fields."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from app.contract.messages import Principal, Quota

if TYPE_CHECKING:  # the supervisor and scheduler use these types and import no SQLAlchemy
    from app.db.models import Tenant

# Every field of a quota, as the tenant's row, the API and the defaults in the settings name them.
ALL_QUOTA_FIELDS: tuple[str, ...] = Quota.__struct_fields__

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
    "max_stored_bytes": 1024 * GIB,  # 1 TiB of inputs, outputs and modules in the shared database
    "max_files_bytes": 4 * GIB,  # a function's files, unpacked; its archive is held in memory at upload
    "scratch_bytes": 4 * GIB,  # a call's writable copy, in memory
    "max_secrets": 10_000,  # every one a function names is decrypted into its calls' environment
    "max_secret_bytes": 256 * 1024**2,  # values of at most 64 KiB each, sealed in the database
    "gpu_weight": 100,  # app/gpu/share.py MAX_WEIGHT
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
    "max_stored_bytes": 0,
    "max_files_bytes": 0,
    "scratch_bytes": 0,
    "max_secrets": 0,
    "max_secret_bytes": 0,
    "gpu_weight": 1,
}


def quota_of(tenant: Tenant) -> Quota:
    return Quota(**{f: getattr(tenant, f) for f in ALL_QUOTA_FIELDS})


def principal_of(tenant: Tenant) -> Principal:
    return Principal(id=tenant.id, name=tenant.name, quota=quota_of(tenant))


def public_quota(quota: Quota) -> dict[str, int | float]:
    """Every field, as the API shows the quota."""
    return msgspec.structs.asdict(quota)
