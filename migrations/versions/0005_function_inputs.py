"""function inputs: default arguments, request variables on demand, a file bundle, scratch

Functions get their default argv (`args`), whether the request variables are added to their
environment (`cgi`; existing functions had them, so they keep them), whether each call gets a
writable copy of their files (`scratch`), and the sha256 of their file bundle (kept in
`function_files`, one archive per function). Async invocations keep the arguments a call passed.
Tenants get the quota fields `max_files_bytes` and `scratch_bytes`.

Revision ID: 0005
Revises: 0004
"""
from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('max_files_bytes', sa.BigInteger(), nullable=False, server_default=str(64 * 1024**2)))
        batch_op.add_column(sa.Column('scratch_bytes', sa.BigInteger(), nullable=False, server_default=str(16 * 1024**2)))
    with op.batch_alter_table('functions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('args', sa.JSON(), nullable=False, server_default='[]'))
        batch_op.add_column(sa.Column('cgi', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('scratch', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('files_sha256', sa.String(length=64), nullable=True))
    # every function deployed before saw the request variables: it keeps them
    op.execute(sa.table('functions', sa.column('cgi', sa.Boolean())).update().values(cgi=True))
    op.create_table(
        'function_files',
        sa.Column('function_id', sa.String(length=32), nullable=False),
        sa.Column('sha256', sa.String(length=64), nullable=False),
        sa.Column('size', sa.BigInteger(), nullable=False),
        sa.Column('unpacked_bytes', sa.BigInteger(), nullable=False),
        sa.Column('entries', sa.Integer(), nullable=False),
        sa.Column('archive', sa.LargeBinary(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['function_id'], ['functions.id'], name=op.f('fk_function_files_function_id_functions'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('function_id', name=op.f('pk_function_files')),
    )
    with op.batch_alter_table('invocations', schema=None) as batch_op:
        batch_op.add_column(sa.Column('args', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('invocations', schema=None) as batch_op:
        batch_op.drop_column('args')
    op.drop_table('function_files')
    with op.batch_alter_table('functions', schema=None) as batch_op:
        batch_op.drop_column('files_sha256')
        batch_op.drop_column('scratch')
        batch_op.drop_column('cgi')
        batch_op.drop_column('args')
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_column('scratch_bytes')
        batch_op.drop_column('max_files_bytes')
