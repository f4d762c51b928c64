"""A journal written before the records layout (revision 0002, commit db01fe8: one row
per event) keeps working (issue 19). fixtures/journal_0002 holds what that code wrote
and printed: the SQLite file, its export, `replay --json` and `verify --json`.

Today's code refuses the file until `kvledger init` migrates it, then reads, verifies,
replays and exports it exactly as the old code did, and appends after the old rows.
On PostgreSQL the same rows, moved into a database at revision 0002 (the old code wrote
the same row values on both backends: one codec), migrate the same way, and the old
export imports into a fresh database with the same results.
"""

from __future__ import annotations

import json
import sqlite3

import pytest

from kvledger import Ledger
from kvledger.journal import make_engine, open_journal, parse_url
from kvledger.journal.builders import allocate_op, make_manifest
from kvledger.journal.tables import SCHEMA_REVISION, VERSION_TABLE
from kvledger.replay import verify_journal
from kvledger.schemas.errors import ErrorCode, KvLedgerError

from stored_rows import FIXTURES, cli, old_journal, one_coded_line, sql

OLD = FIXTURES / "journal_0002"
OLD_EVENTS = len((OLD / "export.jsonl").read_bytes().splitlines())
OLD_TABLES = ("kvl_events", "kvl_heads", "kvl_receipts", "kvl_manifests", "kvl_checkpoints")
LIVE = "old-live"  # left mid-decode by the old code: an append started, not published


@pytest.fixture(params=["sqlite", "postgres"])
def old_url(request, tmp_path) -> str:
    """A writable copy of the old journal, at revision 0002, on the parametrized backend."""
    return old_journal(request, tmp_path, OLD, "0002", OLD_TABLES)


# columns later revisions add to revision 0002's tables (nullable, empty for old rows)
ADDED = {"kvl_heads": {"last_record"}}


def old_rows(url: str) -> dict[str, list[tuple]]:
    """The rows of revision 0002's tables, in a fixed order: what the old code wrote (the
    columns it wrote; ADDED must be NULL in them)."""
    out = {}
    for t in OLD_TABLES:
        rows = [r for r in sql(url, f"SELECT * FROM {t}")]
        cols = list(sql_columns(url, t))
        added = [i for i, c in enumerate(cols) if c in ADDED.get(t, ())]
        assert all(r[i] is None for r in rows for i in added), (t, added)
        out[t] = sorted(tuple(bytes(v) if isinstance(v, memoryview) else v for i, v in enumerate(r) if i not in added)
                        for r in rows)
    return out


def sql_columns(url: str, table: str) -> list[str]:
    engine = make_engine(parse_url(url))
    try:
        with engine.connect() as conn:
            return list(conn.exec_driver_sql(f"SELECT * FROM {table} LIMIT 0").keys())  # constant names
    finally:
        engine.dispose()


def revision(url: str) -> str:
    [(rev,)] = sql(url, f"SELECT version_num FROM {VERSION_TABLE}")
    return rev


def stored_verify() -> dict:
    return json.loads((OLD / "verify.json").read_text())


def same_verify(out: str, backend_storage: bool) -> None:
    """`verify --json` as the old code printed it. `source` names the database (another
    path or server here); on PostgreSQL `storage` names that server's own check, where
    the stored output names SQLite's quick_check."""
    got, want = json.loads(out), stored_verify()
    assert got["ok"] is True and got["events"] == OLD_EVENTS
    skip = {"source", "storage"} if backend_storage else {"source"}
    assert {k: v for k, v in got.items() if k not in skip} == {k: v for k, v in want.items() if k not in skip}


def init(capsys, url: str) -> None:
    code, out, err = cli(capsys, "init", "--db", url, "--json")
    assert code == 0, err
    assert json.loads(out)["revision"] == SCHEMA_REVISION


def test_the_fixture_is_what_the_old_code_wrote():
    """Revision 0002 and no records table: so the tests below exercise the migration."""
    src = sqlite3.connect(OLD / "journal.db")
    try:
        tables = {n for (n,) in src.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert src.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall() == [("0002",)]
        assert src.execute("SELECT count(*) FROM kvl_events").fetchone() == (OLD_EVENTS,)
    finally:
        src.close()
    assert "kvl_records" not in tables and set(OLD_TABLES) <= tables
    assert SCHEMA_REVISION != "0002"


def test_before_init_every_command_says_not_migrated_and_changes_nothing(old_url, capsys, tmp_path):
    before = old_rows(old_url)
    out_file = tmp_path / "never.jsonl"
    for args in (["verify", "--json"], ["replay", "--json"], ["export", "--out", str(out_file)]):
        code, out, err = cli(capsys, *args, "--db", old_url)
        line = one_coded_line(err, "NOT_MIGRATED")
        assert code == 2 and out == "" and "revision 0002" in line and "kvledger init" in line, args
    assert not out_file.exists()
    assert old_rows(old_url) == before and revision(old_url) == "0002"


def test_init_migrates_and_verify_replay_export_match_the_old_outputs(old_url, capsys, tmp_path):
    before = old_rows(old_url)
    init(capsys, old_url)
    assert revision(old_url) == SCHEMA_REVISION
    assert old_rows(old_url) == before  # stored rows are never rewritten; the new tables start empty
    assert sql(old_url, "SELECT count(*) FROM kvl_records") == [(0,)]

    code, out, err = cli(capsys, "verify", "--json", "--db", old_url)
    assert code == 0, err
    same_verify(out, backend_storage=old_url.startswith("postgres"))
    code, out, err = cli(capsys, "replay", "--json", "--db", old_url)
    assert code == 0, err
    assert out == (OLD / "replay.json").read_text()
    code, _, err = cli(capsys, "export", "--db", old_url, "--out", str(tmp_path / "e.jsonl"))
    assert code == 0, err
    assert (tmp_path / "e.jsonl").read_bytes() == (OLD / "export.jsonl").read_bytes()


def test_the_old_export_verifies_and_replays_with_no_database(capsys):
    code, out, err = cli(capsys, "verify", "--json", "--journal", str(OLD / "export.jsonl"))
    assert code == 0, err
    got = json.loads(out)
    assert (got["ok"], got["events"], got["findings"], got["storage"]) == (True, OLD_EVENTS, [], None)
    code, out, err = cli(capsys, "replay", "--json", "--journal", str(OLD / "export.jsonl"))
    assert code == 0, err
    assert out == (OLD / "replay.json").read_text()


def test_appends_go_on_after_the_old_rows(old_url, capsys, tmp_path):
    """Today's code finishes the decode the old code started: the next global positions,
    the stream's next positions and versions; an old operation retried returns its old
    receipt; verify stays clean and the old history reads as before."""
    init(capsys, old_url)
    old = [json.loads(line) for line in (OLD / "export.jsonl").read_text().splitlines()]
    emitted = next(e for e in old if e["stream_id"] == LIVE and e["event_type"] == "output_emit")
    live_positions = [e["stream_position"] for e in old if e["stream_id"] == LIVE]
    with Ledger.open(old_url) as led:
        s = led.state(LIVE)
        assert (s.snapshot_version, s.stream_position, s.committed_length) == (1, max(live_positions), 4)
        g = s.generation
        retry = led.emit(LIVE, base=(g, 1), output_index=0, token_id=7, operation_id=emitted["operation_id"])
        assert (retry.first_global_position, retry.event_ids) == (emitted["global_position"], (emitted["event_id"],))
        with pytest.raises(KvLedgerError) as changed:
            led.emit(LIVE, base=(g, 1), output_index=0, token_id=8, operation_id=emitted["operation_id"])
        assert changed.value.code.value == "CONFLICT"

        receipts = [led.publish(LIVE, txn_id="d1", base=(g, 1)),  # the append the old code started
                    led.emit(LIVE, base=(g, 2), output_index=1, token_id=9),
                    led.finish(LIVE, base=g, reason="max_tokens"),
                    led.release(LIVE, base=g),
                    led.allocate("new-after-old", make_manifest(request_id="new-after-old"), reserved_capacity=16)]
        assert [r.first_global_position for r in receipts] == list(range(OLD_EVENTS + 1, OLD_EVENTS + 6))
        assert [r.handles[0].stream_position for r in receipts] == [*range(max(live_positions) + 1,
                                                                           max(live_positions) + 5), 1]
        assert receipts[0].handles[0].snapshot_version == 2 and receipts[0].handles[0].committed_length == 5
        stream = led.journal.read_stream(LIVE)
        assert [e.stream_position for e in stream] == list(range(1, len(stream) + 1))
        result = verify_journal(led.journal)
    assert result.ok and result.events == OLD_EVENTS + 5, result.findings

    code, out, err = cli(capsys, "replay", "--json", "--db", old_url)
    assert code == 0, err
    handles = {h["handle_id"]: h for h in json.loads(out)["handles"]}
    assert (handles[LIVE]["lifecycle"], handles[LIVE]["output_count"], handles[LIVE]["open_txns"]) == ("RELEASED", 2, 0)
    code, out, err = cli(capsys, "replay", "--json", "--at", str(OLD_EVENTS), "--db", old_url)
    assert code == 0, err
    assert out == (OLD / "replay.json").read_text()  # the old history, as the old code saw it
    export = tmp_path / "after.jsonl"
    assert cli(capsys, "export", "--db", old_url, "--out", str(export))[0] == 0
    lines = export.read_bytes().splitlines(keepends=True)
    assert len(lines) == OLD_EVENTS + 5
    assert b"".join(lines[:OLD_EVENTS]) == (OLD / "export.jsonl").read_bytes()
    code, out, err = cli(capsys, "verify", "--json", "--journal", str(export))
    assert code == 0 and json.loads(out)["events"] == OLD_EVENTS + 5, out + err


def test_the_old_export_imports_with_the_same_results(db_url, backend, capsys):
    code, _, err = cli(capsys, "import", "--db", db_url, str(OLD / "export.jsonl"))
    assert code == 0, err
    code, out, err = cli(capsys, "replay", "--json", "--db", db_url)
    assert code == 0, err
    assert out == (OLD / "replay.json").read_text()
    code, out, err = cli(capsys, "verify", "--json", "--db", db_url)
    assert code == 0, err
    same_verify(out, backend_storage=backend != "sqlite")  # its own storage check, not quick_check


def test_an_event_id_already_in_the_journal_is_refused_at_append(old_url, capsys):
    """DESIGN.md promises a unique event_id at append. Revision 0002 refused one through
    kvl_events' unique index (CONSTRAINT_VIOLATION); since 0005 the append looks its ids up
    in the old rows and in the records' id runs before it writes."""
    init(capsys, old_url)
    with open_journal(old_url) as journal:
        old_id = next(iter(journal.read_all())).event_id
        last = journal.last_position()
        with pytest.raises(KvLedgerError) as exc:
            journal.append([allocate_op("dup-id", event_id=old_id)])
        assert exc.value.code is ErrorCode.CONSTRAINT_VIOLATION and old_id in exc.value.message
        assert journal.last_position() == last and journal.head("dup-id") is None
