"""async outputs in slices: invocation_outputs rows of at most 1 MiB, invocations.output_bytes

A whole output bound or fetched in one statement is copied by the database drivers (on
PostgreSQL read back as hex text); slices are written and read one at a time. Stored outputs
move into slices here, and `invocations.output` goes (dropped in place: a rebuilt SQLite table
would take its slices with it through the cascade).

Revision ID: 0007
Revises: 0006
"""
from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

SLICE = 1 << 20  # app.db.models.OUTPUT_SLICE when written

# the slices of every stored output, in SQL (substr/substring count bytes of a blob from 1)
_SLICE_SQLITE = f"""
WITH RECURSIVE n(i) AS (
    SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < (SELECT max((length(output) - 1) / {SLICE}) FROM invocations)
)
INSERT INTO invocation_outputs (invocation_id, idx, data)
SELECT id, i, substr(output, i * {SLICE} + 1, {SLICE}) FROM invocations JOIN n ON i * {SLICE} < length(output)
WHERE output IS NOT NULL
"""
_SLICE_POSTGRESQL = f"""
INSERT INTO invocation_outputs (invocation_id, idx, data)
SELECT id, i, substring(output FROM i * {SLICE} + 1 FOR {SLICE})
FROM invocations, generate_series(0, (length(output) - 1) / {SLICE}) AS i
WHERE output IS NOT NULL AND length(output) > 0
"""
_JOIN_SQLITE = """
UPDATE invocations SET output = coalesce((
    SELECT CAST(group_concat(data, '') AS BLOB) FROM (
        SELECT data FROM invocation_outputs WHERE invocation_id = invocations.id ORDER BY idx
    )
), X'') WHERE output_bytes IS NOT NULL
"""
_JOIN_POSTGRESQL = """
UPDATE invocations SET output = coalesce((
    SELECT string_agg(data, ''::bytea ORDER BY idx) FROM invocation_outputs WHERE invocation_id = invocations.id
), ''::bytea) WHERE output_bytes IS NOT NULL
"""


def upgrade() -> None:
    op.create_table(
        'invocation_outputs',
        sa.Column('invocation_id', sa.String(length=32), nullable=False),
        sa.Column('idx', sa.Integer(), nullable=False),
        sa.Column('data', sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ['invocation_id'], ['invocations.id'], name=op.f('fk_invocation_outputs_invocation_id_invocations'),
            ondelete='CASCADE',
        ),
        sa.PrimaryKeyConstraint('invocation_id', 'idx', name=op.f('pk_invocation_outputs')),
    )
    op.add_column('invocations', sa.Column('output_bytes', sa.BigInteger(), nullable=True))
    sqlite = op.get_bind().dialect.name == 'sqlite'
    op.execute(_SLICE_SQLITE if sqlite else _SLICE_POSTGRESQL)
    op.execute("UPDATE invocations SET output_bytes = length(output) WHERE output IS NOT NULL")
    op.execute("ALTER TABLE invocations DROP COLUMN output")


def downgrade() -> None:
    op.add_column('invocations', sa.Column('output', sa.LargeBinary(), nullable=True))
    op.execute(_JOIN_SQLITE if op.get_bind().dialect.name == 'sqlite' else _JOIN_POSTGRESQL)
    op.execute("ALTER TABLE invocations DROP COLUMN output_bytes")
    op.drop_table('invocation_outputs')
