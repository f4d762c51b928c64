"""Revision 0002 renames kvl_heads.phase to lifecycle: a journal written at 0001 is
refused until `kvledger init` migrates it, and then reads back unchanged."""

from __future__ import annotations

import msgspec
import pytest
from sqlalchemy import text

from kvledger import migrations
from kvledger.journal import make_engine, open_journal, parse_url
from kvledger.journal.builders import allocate_op
from kvledger.journal.tables import SCHEMA_REVISION
from kvledger.migrations.storage import init_database
from kvledger.schemas.codec import encode_event
from kvledger.schemas.errors import ErrorCode, KvLedgerError


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/j.db"
    return request.getfixturevalue("pg_admin").create(migrated=False)


def write_at_0001(url: str, handles: tuple[str, ...]) -> None:
    """The tables of revision 0001, and an allocation per handle written as 0001 stored
    it: the head's lifecycle in the `phase` column."""
    engine = make_engine(parse_url(url))
    migrations.upgrade(engine, "0001")
    with engine.begin() as conn:
        for position, handle in enumerate(handles, start=1):
            op = allocate_op(handle)
            [write] = op.writes
            [e] = write.events
            h = write.head
            conn.execute(text(
                "INSERT INTO kvl_events (global_position, event_id, stream_id, stream_position, event_type, "
                "schema_version, operation_id, body) VALUES (:p, :id, :s, :sp, :t, :v, :op, :b)"),
                dict(p=position, id=e.event_id, s=e.stream_id, sp=e.stream_position, t=e.event_type,
                     v=e.schema_version, op=e.operation_id,
                     b=encode_event(msgspec.structs.replace(e, global_position=position))))
            conn.execute(text(
                "INSERT INTO kvl_heads (handle_id, request_id, generation, snapshot_version, stream_position, "
                "committed_length, phase, prefix_identity_sha256, cache_abi_sha256) "
                "VALUES (:h, :r, :g, :s, :p, :c, :ph, :pre, :abi)"),
                dict(h=handle, r=h.request_id, g=h.generation, s=h.snapshot_version, p=h.stream_position,
                     c=h.committed_length, ph=h.lifecycle, pre=h.prefix_identity_sha256,
                     abi=h.cache_abi_sha256))
            for sha, body in op.manifests:
                conn.execute(text("INSERT INTO kvl_manifests (manifest_sha256, body) VALUES (:s, :b)"),
                             dict(s=sha, b=body))
    engine.dispose()


def test_a_0001_journal_opens_after_init_migrates_it(empty_url):
    write_at_0001(empty_url, ("A", "B"))
    with pytest.raises(KvLedgerError) as refused:
        open_journal(empty_url)
    assert refused.value.code is ErrorCode.NOT_MIGRATED and "kvledger init" in str(refused.value)

    assert init_database(empty_url) == SCHEMA_REVISION  # through every later revision too
    assert schema_diff(empty_url) == []  # the same tables, keys and indexes as a new journal
    with open_journal(empty_url) as journal:
        heads = journal.heads()
        assert sorted(heads) == ["A", "B"]
        assert all(f.lifecycle == "ACTIVE" and f.stream_position == 1 for f in heads.values())
        assert journal.last_position() == 2
        assert [e.stream_id for e in journal.read_all()] == ["A", "B"]


def schema_diff(url: str) -> list:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from kvledger.journal.tables import VERSION_TABLE, metadata

    engine = make_engine(parse_url(url))
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}), metadata)
    engine.dispose()
    return diff
