"""storage quota: max_stored_bytes per tenant

Bytes of stored async inputs and outputs and of kept module versions a tenant may hold; existing
tenants get the default of 1 GiB (TENSORWASM_DEFAULT_MAX_STORED_BYTES sets it for new ones).

Revision ID: 0004
Revises: 0003
"""
from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('max_stored_bytes', sa.BigInteger(), nullable=False, server_default=str(1024**3)))


def downgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_column('max_stored_bytes')
