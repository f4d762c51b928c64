"""records: one row per commit (kvledger.journal.record_format), with the lookup rows that
find a stream's and an operation's records; the one-row-per-event tables stay for the
events written before (and for imports)

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "kvl_records",
        sa.Column("last_position", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("first_position", sa.BigInteger, nullable=False),
        sa.Column("chain", sa.LargeBinary, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
    )
    # Keyed lookups: 8-byte keys of the ids (records.stable_key), one row per (stream,
    # record) and per (operation, record); WITHOUT ROWID keeps each row in the key's
    # own B-tree on SQLite (no second copy of the key).
    for table, key in (("kvl_record_streams", "stream_key"), ("kvl_record_ops", "op_key")):
        op.create_table(
            table,
            sa.Column(key, sa.BigInteger, primary_key=True, autoincrement=False),
            sa.Column("last_position", sa.BigInteger, primary_key=True, autoincrement=False),
            sqlite_with_rowid=False,
        )


def downgrade() -> None:
    for table in ("kvl_record_ops", "kvl_record_streams", "kvl_records"):
        op.drop_table(table)
