"""kvl_heads.phase renamed lifecycle: it holds the request's lifecycle (ACTIVE,
FINISHED, CANCELLED, RELEASED), not the view's phase

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch: SQLite alters a column by rebuilding the table when it must; PostgreSQL
    # renames in place. Rows, the primary key and the prefix index stay.
    with op.batch_alter_table("kvl_heads") as batch:
        batch.alter_column("phase", new_column_name="lifecycle",
                           existing_type=sa.String(32), existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("kvl_heads") as batch:
        batch.alter_column("lifecycle", new_column_name="phase",
                           existing_type=sa.String(32), existing_nullable=False)
