"""journal tables: events, heads, receipts, manifests, checkpoints

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "kvl_events",
        sa.Column("global_position", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("event_id", sa.String(256), nullable=False, unique=True),
        sa.Column("stream_id", sa.String(256), nullable=False),
        sa.Column("stream_position", sa.BigInteger, nullable=False),
        sa.Column("event_type", sa.String(64), nullable=False),
        sa.Column("schema_version", sa.Integer, nullable=False),
        sa.Column("operation_id", sa.String(256)),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.UniqueConstraint("stream_id", "stream_position", name="kvl_events_stream_uq"),
    )
    op.create_index("kvl_events_operation_ix", "kvl_events", ["operation_id"])
    op.create_table(
        "kvl_heads",
        sa.Column("handle_id", sa.String(256), primary_key=True),
        sa.Column("request_id", sa.String(256), nullable=False),
        sa.Column("generation", sa.BigInteger, nullable=False),
        sa.Column("snapshot_version", sa.BigInteger, nullable=False),
        sa.Column("stream_position", sa.BigInteger, nullable=False),
        sa.Column("committed_length", sa.BigInteger, nullable=False),
        sa.Column("phase", sa.String(32), nullable=False),
        sa.Column("prefix_identity_sha256", sa.String(64), nullable=False),
        sa.Column("cache_abi_sha256", sa.String(64), nullable=False),
    )
    op.create_index("kvl_heads_prefix_ix", "kvl_heads", ["prefix_identity_sha256"])
    op.create_table(
        "kvl_receipts",
        sa.Column("operation_id", sa.String(256), primary_key=True),
        sa.Column("fingerprint", sa.String(128), nullable=False),
        sa.Column("first_global_position", sa.BigInteger, nullable=False),
        sa.Column("last_global_position", sa.BigInteger, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "kvl_manifests",
        sa.Column("manifest_sha256", sa.String(64), primary_key=True),
        sa.Column("body", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "kvl_checkpoints",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("position", sa.BigInteger, nullable=False),
        sa.Column("state", sa.LargeBinary, nullable=False),
        sa.Column("updated_wall_ns", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    for table in ("kvl_checkpoints", "kvl_manifests", "kvl_receipts", "kvl_heads", "kvl_events"):
        op.drop_table(table)
