"""Streams found by a chain through the records instead of a lookup row per (stream,
record): kvl_heads.last_record and kvl_records.stream_prev (kvledger.journal.keys.
pack_prev). Records written before keep their kvl_record_streams rows.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

PAGE = 256  # records read at a time


def upgrade() -> None:
    # NULL in both: written before, indexed by kvl_record_streams (nothing to rewrite)
    op.add_column("kvl_heads", sa.Column("last_record", sa.BigInteger))
    op.add_column("kvl_records", sa.Column("stream_prev", sa.LargeBinary))


def downgrade() -> None:
    from kvledger.journal.audit import record_streams
    from kvledger.journal.keys import stable_key

    conn = op.get_bind()
    read = sa.text("SELECT last_position, body FROM kvl_records WHERE stream_prev IS NOT NULL "
                   "AND last_position > :after ORDER BY last_position LIMIT :n")
    insert = sa.text("INSERT INTO kvl_record_streams (stream_key, last_position) VALUES (:k, :p)")
    after = 0
    while True:
        page = conn.execute(read, {"after": after, "n": PAGE}).fetchall()
        rows = [{"k": k, "p": last} for last, body in page
                for k in sorted({stable_key(s) for s in record_streams(bytes(body)) or ()})]
        if rows:
            conn.execute(insert, rows)
        if len(page) < PAGE:
            break
        after = page[-1][0]
    op.drop_column("kvl_records", "stream_prev")
    op.drop_column("kvl_heads", "last_record")
