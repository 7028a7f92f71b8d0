"""versions that hold a function's settings, pinned calls, and secrets

Each version keeps what a call of it runs: besides its module, the env, args, cgi, scratch,
content type, timeout and the names of the secrets it gets (the function's columns stay the
active version's, for its readers). Versions deployed before this revision get the function's
settings as they are now: older ones were not kept. Functions get `secrets` (names); async
invocations keep the version a submit pinned (`pinned_version`). Tenants keep secrets
(`secrets`, values encrypted by the node key) within the quota fields `max_secrets` and
`max_secret_bytes`.

Revision ID: 0008
Revises: 0007
"""
from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None

_SETTINGS = ('env', 'args', 'cgi', 'scratch', 'content_type', 'timeout_ms')


def upgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('max_secrets', sa.Integer(), nullable=False, server_default='100'))
        batch_op.add_column(sa.Column('max_secret_bytes', sa.BigInteger(), nullable=False, server_default=str(1024**2)))
    with op.batch_alter_table('functions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('secrets', sa.JSON(), nullable=False, server_default='[]'))
    with op.batch_alter_table('function_versions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('env', sa.JSON(), nullable=False, server_default='{}'))
        batch_op.add_column(sa.Column('args', sa.JSON(), nullable=False, server_default='[]'))
        batch_op.add_column(sa.Column('cgi', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('scratch', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('content_type', sa.String(length=255), nullable=False,
                                      server_default='application/octet-stream'))
        batch_op.add_column(sa.Column('timeout_ms', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('secrets', sa.JSON(), nullable=False, server_default='[]'))
    with op.batch_alter_table('invocations', schema=None) as batch_op:
        batch_op.add_column(sa.Column('pinned_version', sa.Integer(), nullable=True))
    # every kept version gets its function's settings (the only ones known)
    functions = sa.table('functions', sa.column('id', sa.String()), *(sa.column(c) for c in _SETTINGS))
    versions = sa.table('function_versions', sa.column('function_id', sa.String()), *(sa.column(c) for c in _SETTINGS))
    op.execute(versions.update().values({
        c: sa.select(functions.c[c]).where(functions.c.id == versions.c.function_id).scalar_subquery() for c in _SETTINGS
    }))
    op.create_table(
        'secrets',
        sa.Column('id', sa.String(length=32), nullable=False),
        sa.Column('tenant_id', sa.String(length=32), nullable=False),
        sa.Column('name', sa.String(length=128), nullable=False),
        sa.Column('ciphertext', sa.LargeBinary(), nullable=False),
        sa.Column('size', sa.Integer(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_secrets_tenant_id_tenants'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_secrets')),
        sa.UniqueConstraint('tenant_id', 'name', name=op.f('uq_secrets_tenant_id')),
    )
    op.create_index(op.f('ix_secrets_tenant_id'), 'secrets', ['tenant_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_secrets_tenant_id'), table_name='secrets')
    op.drop_table('secrets')
    with op.batch_alter_table('invocations', schema=None) as batch_op:
        batch_op.drop_column('pinned_version')
    with op.batch_alter_table('function_versions', schema=None) as batch_op:
        for column in ('secrets', *reversed(_SETTINGS)):
            batch_op.drop_column(column)
    with op.batch_alter_table('functions', schema=None) as batch_op:
        batch_op.drop_column('secrets')
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_column('max_secret_bytes')
        batch_op.drop_column('max_secrets')
