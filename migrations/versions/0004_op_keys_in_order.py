"""kvl_record_ops keyed in a writer's order (kvledger.journal.keys.op_key): the rows
revision 0003 keyed by a hash of the operation id are keyed again from their records

Revision ID: 0004
Revises: 0003
"""

from collections.abc import Callable

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

PAGE = 256  # records read at a time


def _rekey(key: Callable[[str], int]) -> None:
    """Every kvl_record_ops row keyed again by `key` of the operation ids its record
    holds. A record that no longer decodes keeps the rows it had: what its keys should be
    is lost with it, and `kvledger verify` reports the record."""
    from kvledger.journal.audit import operation_ids

    conn = op.get_bind()
    read = sa.text("SELECT last_position, body FROM kvl_records WHERE last_position > :after "
                   "ORDER BY last_position LIMIT :n")
    drop = sa.text("DELETE FROM kvl_record_ops WHERE last_position = :p")
    insert = sa.text("INSERT INTO kvl_record_ops (op_key, last_position) VALUES (:k, :p)")
    after = 0
    while True:
        page = conn.execute(read, {"after": after, "n": PAGE}).fetchall()
        done, rows = [], []
        for last, body in page:
            ids = operation_ids(bytes(body))
            if ids is not None:
                done.append({"p": last})
                rows += [{"k": k, "p": last} for k in sorted({key(o) for o in ids})]
        if done:
            conn.execute(drop, done)
            conn.execute(insert, rows)
        if len(page) < PAGE:
            return
        after = page[-1][0]


def upgrade() -> None:
    from kvledger.journal.keys import op_key

    _rekey(op_key)


def downgrade() -> None:
    from kvledger.journal.keys import stable_key

    _rekey(stable_key)
