"""cluster failover: node heartbeats, bounded retries of async work whose node was lost

Nodes heartbeat in `nodes`; the async work of a node not seen for a while is queued again.
Functions get `max_attempts` (default 3); invocations record their `attempt`, the
`max_attempts` they were submitted with, and the attempts their node lost. Existing
invocations count as their first attempt of one.

Revision ID: 0006
Revises: 0005
"""
from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'nodes',
        sa.Column('id', sa.String(length=64), nullable=False),
        sa.Column('host', sa.String(length=255), nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('last_seen', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_nodes')),
    )
    op.create_index(op.f('ix_nodes_last_seen'), 'nodes', ['last_seen'], unique=False)
    with op.batch_alter_table('functions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('max_attempts', sa.Integer(), nullable=False, server_default='3'))
    with op.batch_alter_table('invocations', schema=None) as batch_op:
        batch_op.add_column(sa.Column('attempt', sa.Integer(), nullable=False, server_default='1'))
        batch_op.add_column(sa.Column('max_attempts', sa.Integer(), nullable=False, server_default='1'))
        batch_op.add_column(sa.Column('lost_attempts', sa.JSON(), nullable=True))
    # work queued at the upgrade has not run yet: its first claim makes it attempt 1
    invocations = sa.table('invocations', sa.column('attempt', sa.Integer()), sa.column('status', sa.String()))
    op.execute(invocations.update().where(invocations.c.status == 'queued').values(attempt=0))


def downgrade() -> None:
    with op.batch_alter_table('invocations', schema=None) as batch_op:
        batch_op.drop_column('lost_attempts')
        batch_op.drop_column('max_attempts')
        batch_op.drop_column('attempt')
    with op.batch_alter_table('functions', schema=None) as batch_op:
        batch_op.drop_column('max_attempts')
    op.drop_index(op.f('ix_nodes_last_seen'), table_name='nodes')
    op.drop_table('nodes')
