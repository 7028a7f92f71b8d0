"""callback secrets sealed

A tenant's callback signing secret is kept sealed with the node key, as its own secrets are; a
value written in clear before this revision stays in `secret` until a node first reads it and
seals it (sealing needs the node key, which a migration does not have).

Revision ID: 0011
Revises: 0010
"""
from alembic import op
import sqlalchemy as sa


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('callback_secrets', schema=None) as batch_op:
        batch_op.add_column(sa.Column('ciphertext', sa.LargeBinary(), nullable=True))
        batch_op.alter_column('secret', existing_type=sa.String(length=128), nullable=True)


def downgrade() -> None:
    # a sealed secret cannot be written back in clear without the node key: those rows go, and
    # their tenants get a new secret at the next use
    op.execute("DELETE FROM callback_secrets WHERE secret IS NULL")
    with op.batch_alter_table('callback_secrets', schema=None) as batch_op:
        batch_op.alter_column('secret', existing_type=sa.String(length=128), nullable=False)
        batch_op.drop_column('ciphertext')
