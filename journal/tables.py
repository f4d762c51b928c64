"""SQLAlchemy Core tables of the journal. Migrations create them (migrations/versions);
this module is the code's view of the same columns."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    UniqueConstraint,
)

from kvledger.schemas.errors import ErrorCode, KvLedgerError

# Every alembic revision this code knows (migrations/versions), oldest first; the last
# is the head it reads and writes. A database at a revision not listed here was written
# by a newer kvledger. (tests/test_cli_foundation checks this against alembic.)
REVISIONS = ("0001", "0002", "0003", "0004", "0005", "0006")
SCHEMA_REVISION = REVISIONS[-1]
VERSION_TABLE = "kvl_alembic_version"
JOURNAL_TABLES = ("kvl_events", "kvl_heads", "kvl_receipts", "kvl_manifests", "kvl_checkpoints", "kvl_records",
                  "kvl_record_streams", "kvl_record_ids")


def too_new(revision: str, where: str) -> KvLedgerError:
    return KvLedgerError(
        ErrorCode.DATABASE_TOO_NEW,
        f"{where} is at schema revision {revision!r}, written by a newer kvledger (this one knows "
        f"revisions up to {SCHEMA_REVISION}): use that kvledger version or a newer one",
    )

metadata = MetaData()

events = Table(
    "kvl_events",
    metadata,
    Column("global_position", BigInteger, primary_key=True, autoincrement=False),
    Column("event_id", String(256), nullable=False, unique=True),
    Column("stream_id", String(256), nullable=False),
    Column("stream_position", BigInteger, nullable=False),
    Column("event_type", String(64), nullable=False),
    Column("schema_version", Integer, nullable=False),
    Column("operation_id", String(256)),
    Column("body", LargeBinary, nullable=False),
    UniqueConstraint("stream_id", "stream_position", name="kvl_events_stream_uq"),
    Index("kvl_events_operation_ix", "operation_id"),
)

heads = Table(
    "kvl_heads",
    metadata,
    Column("handle_id", String(256), primary_key=True),
    Column("request_id", String(256), nullable=False),
    Column("generation", BigInteger, nullable=False),
    Column("snapshot_version", BigInteger, nullable=False),
    Column("stream_position", BigInteger, nullable=False),
    Column("committed_length", BigInteger, nullable=False),
    Column("lifecycle", String(32), nullable=False),
    Column("prefix_identity_sha256", String(64), nullable=False),
    Column("cache_abi_sha256", String(64), nullable=False),
    # Since 0006: the last record holding an event of the handle (NULL: none since 0006),
    # where read_stream starts following the records' stream_prev chain back.
    Column("last_record", BigInteger),
    Index("kvl_heads_prefix_ix", "prefix_identity_sha256"),
)

receipts = Table(
    "kvl_receipts",
    metadata,
    Column("operation_id", String(256), primary_key=True),
    Column("fingerprint", String(128), nullable=False),
    Column("first_global_position", BigInteger, nullable=False),
    Column("last_global_position", BigInteger, nullable=False),
    Column("body", LargeBinary, nullable=False),
)

manifests = Table(
    "kvl_manifests",
    metadata,
    Column("manifest_sha256", String(64), primary_key=True),
    Column("body", LargeBinary, nullable=False),
)

checkpoints = Table(
    "kvl_checkpoints",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("position", BigInteger, nullable=False),
    Column("state", LargeBinary, nullable=False),
    Column("updated_wall_ns", BigInteger, nullable=False),
)

# Since 0003 appends write records (kvledger.journal.record_format), one per commit; the
# tables above keep the events written before, and imports.
records = Table(
    "kvl_records",
    metadata,
    Column("last_position", BigInteger, primary_key=True, autoincrement=False),
    Column("first_position", BigInteger, nullable=False),
    Column("chain", LargeBinary, nullable=False),
    Column("body", LargeBinary, nullable=False),
    # Since 0006 (journal.keys.pack_prev): for each stream the record holds, in the
    # order its events first name them, the record before it on that stream. NULL: a
    # record written before, whose streams kvl_record_streams indexes.
    Column("stream_prev", LargeBinary),
)

record_streams = Table(
    "kvl_record_streams",
    metadata,
    Column("stream_key", BigInteger, primary_key=True, autoincrement=False),
    Column("last_position", BigInteger, primary_key=True, autoincrement=False),
    sqlite_with_rowid=False,
)

# Runs of consecutive id keys (journal.keys.id_runs), one row a run: which records hold
# an operation or event id (revision 0005; it replaced 0003's kvl_record_ops, a row per
# operation). The key (first_key, last_position) makes the stab of records.stab an index range.
record_ids = Table(
    "kvl_record_ids",
    metadata,
    Column("first_key", BigInteger, primary_key=True, autoincrement=False),
    Column("last_position", BigInteger, primary_key=True, autoincrement=False),
    Column("last_key", BigInteger, nullable=False),
    sqlite_with_rowid=False,
)
