"""function logs and callbacks

`function_logs` keeps what calls wrote to stderr, per tenant within a byte budget, for
`GET /v1/functions/{name}/logs`. `callback_secrets` holds each tenant's callback signing key;
`callback_deliveries` the pending and finished callbacks of async invocations submitted with
X-Callback-Url, so a node that restarts still sends them.

Revision ID: 0009
Revises: 0008
"""
from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'function_logs',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('tenant_id', sa.String(length=32), nullable=False),
        sa.Column('function', sa.String(length=63), nullable=False),
        sa.Column('invocation_id', sa.String(length=32), nullable=False),
        sa.Column('version', sa.Integer(), nullable=True),
        sa.Column('at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('text', sa.Text(), nullable=False),
        sa.Column('size', sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_function_logs_tenant_id_tenants'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_function_logs')),
    )
    op.create_index('ix_function_logs_tenant_function_id', 'function_logs', ['tenant_id', 'function', 'id'], unique=False)
    op.create_index(op.f('ix_function_logs_tenant_id'), 'function_logs', ['tenant_id'], unique=False)
    op.create_table(
        'callback_secrets',
        sa.Column('tenant_id', sa.String(length=32), nullable=False),
        sa.Column('secret', sa.String(length=128), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_callback_secrets_tenant_id_tenants'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('tenant_id', name=op.f('pk_callback_secrets')),
    )
    op.create_table(
        'callback_deliveries',
        sa.Column('invocation_id', sa.String(length=32), nullable=False),
        sa.Column('tenant_id', sa.String(length=32), nullable=False),
        sa.Column('url', sa.String(length=2048), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('attempts', sa.Integer(), nullable=False),
        sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('first_attempt_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('last_status_code', sa.Integer(), nullable=True),
        sa.Column('last_error', sa.String(length=1024), nullable=True),
        sa.Column('delivered_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['invocation_id'], ['invocations.id'], name=op.f('fk_callback_deliveries_invocation_id_invocations'), ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_callback_deliveries_tenant_id_tenants'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('invocation_id', name=op.f('pk_callback_deliveries')),
    )
    op.create_index('ix_callback_deliveries_status_next', 'callback_deliveries', ['status', 'next_attempt_at'], unique=False)
    op.create_index(op.f('ix_callback_deliveries_tenant_id'), 'callback_deliveries', ['tenant_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_callback_deliveries_tenant_id'), table_name='callback_deliveries')
    op.drop_index('ix_callback_deliveries_status_next', table_name='callback_deliveries')
    op.drop_table('callback_deliveries')
    op.drop_table('callback_secrets')
    op.drop_index(op.f('ix_function_logs_tenant_id'), table_name='function_logs')
    op.drop_index('ix_function_logs_tenant_function_id', table_name='function_logs')
    op.drop_table('function_logs')
