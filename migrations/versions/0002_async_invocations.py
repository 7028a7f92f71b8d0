"""async invocations: mode, queue columns, stored input/output, max_queued quota

Revision ID: 0002
Revises: 0001
"""
from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('max_queued', sa.Integer(), nullable=False, server_default='1000'))

    with op.batch_alter_table('invocations', schema=None) as batch_op:
        batch_op.add_column(sa.Column('mode', sa.String(length=16), nullable=False, server_default='sync'))
        batch_op.add_column(sa.Column('created_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('idempotency_key', sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column('query_string', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('request_content_type', sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column('input', sa.LargeBinary(), nullable=True))
        batch_op.add_column(sa.Column('output', sa.LargeBinary(), nullable=True))
        batch_op.add_column(sa.Column('content_type', sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column('claimed_by', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('cancel_requested', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.alter_column('started_at', existing_type=sa.DateTime(timezone=True), nullable=True)
        batch_op.alter_column('duration_ms', existing_type=sa.Float(), nullable=True)
    op.execute("UPDATE invocations SET created_at = started_at")
    with op.batch_alter_table('invocations', schema=None) as batch_op:
        batch_op.alter_column('created_at', existing_type=sa.DateTime(timezone=True), nullable=False)
        batch_op.create_index('ix_invocations_tenant_created', ['tenant_id', 'created_at', 'id'], unique=False)
        batch_op.create_index('ix_invocations_status_created', ['status', 'created_at'], unique=False)
        batch_op.create_index('ix_invocations_tenant_status', ['tenant_id', 'status'], unique=False)
        batch_op.create_unique_constraint('uq_invocations_tenant_idempotency_key', ['tenant_id', 'idempotency_key'])


def downgrade() -> None:
    op.execute("DELETE FROM invocations WHERE started_at IS NULL")
    op.execute("UPDATE invocations SET duration_ms = 0 WHERE duration_ms IS NULL")
    with op.batch_alter_table('invocations', schema=None) as batch_op:
        batch_op.drop_constraint('uq_invocations_tenant_idempotency_key', type_='unique')
        batch_op.drop_index('ix_invocations_tenant_status')
        batch_op.drop_index('ix_invocations_status_created')
        batch_op.drop_index('ix_invocations_tenant_created')
        batch_op.alter_column('duration_ms', existing_type=sa.Float(), nullable=False)
        batch_op.alter_column('started_at', existing_type=sa.DateTime(timezone=True), nullable=False)
        for col in ('cancel_requested', 'lease_expires_at', 'claimed_by', 'content_type', 'output', 'input',
                    'request_content_type', 'query_string', 'idempotency_key', 'ended_at', 'created_at', 'mode'):
            batch_op.drop_column(col)
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_column('max_queued')
