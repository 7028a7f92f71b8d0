"""invocation record indexes

Fewer B-trees to update per invocation record written (every synchronous call writes one): the
index on tenant_id alone goes (the table's other indexes that serve a tenant start with
tenant_id, which serves its lookups and the tenant's cascade); the (tenant_id, idempotency_key)
uniqueness becomes a partial unique index over the rows that carry a key, and the two status
indexes (the async queue's) cover async rows only. A synchronous record then updates the primary
key and two indexes instead of six. On SQLite the table is copied once to drop its old
constraint.

Revision ID: 0012
Revises: 0011
"""
from alembic import op
import sqlalchemy as sa


revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None

_KEYED = sa.text('idempotency_key IS NOT NULL')
_ASYNC = sa.text("mode = 'async'")
_STATUS = {'ix_invocations_status_created': ['status', 'created_at'], 'ix_invocations_tenant_status': ['tenant_id', 'status']}


def upgrade() -> None:
    with op.batch_alter_table('invocations', schema=None) as batch_op:
        batch_op.drop_constraint('uq_invocations_tenant_idempotency_key', type_='unique')
        batch_op.drop_index(batch_op.f('ix_invocations_tenant_id'))
        for name in _STATUS:
            batch_op.drop_index(name)
    op.create_index(
        'uq_invocations_tenant_idempotency_key', 'invocations', ['tenant_id', 'idempotency_key'], unique=True,
        sqlite_where=_KEYED, postgresql_where=_KEYED,
    )
    for name, columns in _STATUS.items():
        op.create_index(name, 'invocations', columns, sqlite_where=_ASYNC, postgresql_where=_ASYNC)


def downgrade() -> None:
    op.drop_index('uq_invocations_tenant_idempotency_key', table_name='invocations')
    for name in _STATUS:
        op.drop_index(name, table_name='invocations')
    with op.batch_alter_table('invocations', schema=None) as batch_op:
        for name, columns in _STATUS.items():
            batch_op.create_index(name, columns, unique=False)
        batch_op.create_index(batch_op.f('ix_invocations_tenant_id'), ['tenant_id'], unique=False)
        batch_op.create_unique_constraint('uq_invocations_tenant_idempotency_key', ['tenant_id', 'idempotency_key'])
