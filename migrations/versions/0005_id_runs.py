"""kvl_record_ids: runs of consecutive operation and event id keys, one row a run
(kvledger.journal.keys.id_runs), instead of kvl_record_ops' row per operation; an
append refuses an event id already in the journal again

Revision ID: 0005
Revises: 0004
"""

from collections.abc import Iterator

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

PAGE = 256  # records read at a time


def _records(conn: sa.Connection) -> Iterator[tuple[int, bytes]]:
    """Every record, a page at a time (each page read whole before its rows are written)."""
    read = sa.text("SELECT last_position, body FROM kvl_records WHERE last_position > :after "
                   "ORDER BY last_position LIMIT :n")
    after = 0
    while True:
        page = conn.execute(read, {"after": after, "n": PAGE}).fetchall()
        for last, body in page:
            yield last, bytes(body)
        if len(page) < PAGE:
            return
        after = page[-1][0]


def upgrade() -> None:
    from kvledger.journal.audit import record_ids
    from kvledger.journal.keys import id_keys, id_runs

    op.create_table(
        "kvl_record_ids",
        sa.Column("first_key", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("last_position", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("last_key", sa.BigInteger, nullable=False),
        sqlite_with_rowid=False,
    )
    conn = op.get_bind()
    insert = sa.text("INSERT INTO kvl_record_ids (first_key, last_key, last_position) VALUES (:f, :l, :p)")
    old = sa.text("SELECT op_key FROM kvl_record_ops WHERE last_position = :p")
    for last, body in _records(conn):
        ids = record_ids(body)
        if ids is None:
            # A record that no longer decodes: what its ids are is lost with it (verify
            # reports it); its operation rows carry over, each a run of one key.
            keys = [k for (k,) in conn.execute(old, {"p": last})]
        else:
            keys = id_keys(ids[0] | ids[1])
        rows = [{"f": f, "l": lk, "p": last} for f, lk in id_runs(keys)]
        if rows:
            conn.execute(insert, rows)
    op.drop_table("kvl_record_ops")


def downgrade() -> None:
    from kvledger.journal.audit import operation_ids
    from kvledger.journal.keys import op_key

    op.create_table(
        "kvl_record_ops",
        sa.Column("op_key", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("last_position", sa.BigInteger, primary_key=True, autoincrement=False),
        sqlite_with_rowid=False,
    )
    conn = op.get_bind()
    insert = sa.text("INSERT INTO kvl_record_ops (op_key, last_position) VALUES (:k, :p)")
    for last, body in _records(conn):
        ids = operation_ids(body)
        rows = [{"k": k, "p": last} for k in sorted({op_key(o) for o in ids or ()})]
        if rows:
            conn.execute(insert, rows)
    op.drop_table("kvl_record_ids")
