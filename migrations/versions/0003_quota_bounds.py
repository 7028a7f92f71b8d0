"""quota values within their documented bounds

Quota fields now have upper bounds (app/api/schemas.py QUOTA_BOUNDS); a tenant stored before
with a larger value is brought down to the bound, so every stored quota is one the API accepts
and answers. The bounds are copied here: a migration must not change when the code does.

Revision ID: 0003
Revises: 0002
"""
from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

BOUNDS = {
    "gpu_memory_bytes": 1024 * 1024**3,
    "max_concurrency": 1024,
    "requests_per_second": 1_000_000.0,
    "max_functions": 100_000,
    "max_module_bytes": 256 * 1024**2,
    "wasm_memory_bytes": 4 * 1024**3,
    "timeout_ms": 3_600_000,
    "max_queued": 1_000_000,
}

MIN_RATE = 0.001


def upgrade() -> None:
    tenants = sa.table("tenants", *(sa.column(name) for name in BOUNDS))
    for name, bound in BOUNDS.items():
        col = tenants.c[name]
        op.execute(tenants.update().where(col > bound).values({name: bound}))
    # a rate too small to ever refill a token once made retry times overflow
    rate = tenants.c.requests_per_second
    op.execute(tenants.update().where(rate < MIN_RATE).values(requests_per_second=MIN_RATE))


def downgrade() -> None:
    pass  # the clamped values were outside what the platform supports; nothing to restore
