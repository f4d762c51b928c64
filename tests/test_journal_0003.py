"""A journal of records written by revision 0003's code (commit 16fcafa) keeps working
after revision 0004 keys kvl_record_ops in each writer's order (journal.keys.op_key)
and revision 0005 replaces those rows with runs of event and operation id keys
(kvl_record_ids, journal.keys.id_runs).
fixtures/journal_0003 holds what that code wrote and printed: the SQLite file, its
export, `replay --json`, `verify --json` and every receipt.

`kvledger init` builds the id runs from the records, and nothing else changes: verify
(which checks every lookup row against its record) is clean, replay and export print
what the old code printed, and every old operation's receipt is found by its id (what
makes a retry of it idempotent). A downgrade gives back the old rows, and one to 0004
the rows 0004 keyed in order.
"""

from __future__ import annotations

import bisect
import json
import sqlite3

import pytest
from alembic import command

from kvledger import migrations
from kvledger.journal import make_engine, open_journal, parse_url
from kvledger.journal.keys import id_key, id_runs, op_key, stable_key
from kvledger.journal.tables import SCHEMA_REVISION, VERSION_TABLE
from kvledger.schemas.receipts import receipt_decoder

from stored_rows import FIXTURES, cli, old_journal, one_coded_line, reads_as_recorded, sql

OLD = FIXTURES / "journal_0003"
TABLES = ("kvl_heads", "kvl_manifests", "kvl_checkpoints", "kvl_records", "kvl_record_streams", "kvl_record_ops")
RECEIPTS = [receipt_decoder.decode(line) for line in (OLD / "receipts.jsonl").read_bytes().splitlines()]


@pytest.fixture(params=["sqlite", "postgres"])
def old_url(request, tmp_path) -> str:
    """A writable copy of the fixture, at revision 0003, on the parametrized backend."""
    return old_journal(request, tmp_path, OLD, "0003", TABLES)


def op_rows(url: str) -> list[tuple[int, int]]:
    return sorted(sql(url, "SELECT op_key, last_position FROM kvl_record_ops"))


def _record_ends() -> list[int]:
    src = sqlite3.connect(f"file:{OLD / 'journal.db'}?mode=ro", uri=True)  # never an empty new file
    try:
        return sorted(last for (last,) in src.execute("SELECT last_position FROM kvl_records"))
    finally:
        src.close()


RECORD_ENDS = _record_ends()


def _record_end(r) -> int:
    return RECORD_ENDS[bisect.bisect_left(RECORD_ENDS, r.last_global_position)]


def keyed_by(key) -> list[tuple[int, int]]:
    """The kvl_record_ops rows `key` gives: (key, the record's last position) of each
    operation, from the receipts the old code returned."""
    return sorted({(key(r.operation_id), _record_end(r)) for r in RECEIPTS})


def id_runs_wanted() -> list[tuple[int, int, int]]:
    """The kvl_record_ids rows: (first key, last key, the record's last position) of the
    runs of each record's event and operation id keys, from the old code's receipts."""
    keys: dict[int, set[int]] = {}
    for r in RECEIPTS:
        keys.setdefault(_record_end(r), set()).update(id_key(i) for i in (r.operation_id, *r.event_ids))
    return sorted((a, b, last) for last, ks in keys.items() for a, b in id_runs(ks))


def id_rows(url: str) -> list[tuple[int, int, int]]:
    return sorted(sql(url, "SELECT first_key, last_key, last_position FROM kvl_record_ids"))


def revision(url: str) -> str:
    [(rev,)] = sql(url, f"SELECT version_num FROM {VERSION_TABLE}")
    return rev


def test_the_fixture_is_revision_0003_with_hashed_operation_keys(old_url):
    assert revision(old_url) == "0003" and SCHEMA_REVISION != "0003"
    assert len(RECEIPTS) > 50 and op_rows(old_url) == keyed_by(stable_key)
    assert keyed_by(op_key) != keyed_by(stable_key)  # the migration has work to do


def test_before_init_it_is_refused_and_unchanged(old_url, capsys):
    before = op_rows(old_url)
    code, out, err = cli(capsys, "verify", "--json", "--db", old_url)
    assert code == 2 and out == "" and "revision 0003" in one_coded_line(err, "NOT_MIGRATED")
    assert op_rows(old_url) == before


def test_init_indexes_id_runs_and_the_journal_reads_as_before(old_url, capsys, tmp_path):
    streams = sorted(sql(old_url, "SELECT stream_key, last_position FROM kvl_record_streams"))
    records = sorted(sql(old_url, "SELECT last_position, body FROM kvl_records"))
    code, out, err = cli(capsys, "init", "--db", old_url, "--json")
    assert code == 0, err
    assert revision(old_url) == SCHEMA_REVISION
    runs = id_rows(old_url)
    assert runs == id_runs_wanted()
    # one writer's ids are consecutive: far fewer runs than ids (0003 had a row per operation)
    assert len(runs) * 8 < len(RECEIPTS) + sum(len(r.event_ids) for r in RECEIPTS)
    # only the id lookup rows changed
    assert sorted(sql(old_url, "SELECT stream_key, last_position FROM kvl_record_streams")) == streams
    assert sorted(sql(old_url, "SELECT last_position, body FROM kvl_records")) == records

    reads_as_recorded(capsys, old_url, OLD, tmp_path, RECEIPTS)


@pytest.mark.parametrize("column", ["first_key", "last_key"])
def test_a_wrong_id_run_is_found_by_verify_after_init(old_url, capsys, column):
    """The built rows are checked like any other: verify recomputes the runs."""
    assert cli(capsys, "init", "--db", old_url)[0] == 0
    [(first, last)] = sql(old_url, "SELECT first_key, last_position FROM kvl_record_ids "
                                   "ORDER BY last_position LIMIT 1")
    # constant column names
    sql(old_url, f"UPDATE kvl_record_ids SET {column} = {column} - 1 WHERE first_key = :f AND last_position = :p",
        f=first, p=last)
    code, out, _ = cli(capsys, "verify", "--json", "--db", old_url)
    assert code == 1 and not json.loads(out)["ok"]
    assert any("ids lookup rows" in f["message"] for f in json.loads(out)["findings"])


def _downgrade(url: str, to: str) -> None:
    engine = make_engine(parse_url(url))
    try:
        with engine.begin() as conn:
            cfg = migrations._config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, to)
    finally:
        engine.dispose()


def test_downgrade_gives_back_the_hashed_keys(old_url, capsys):
    before = op_rows(old_url)
    assert cli(capsys, "init", "--db", old_url)[0] == 0
    _downgrade(old_url, "0004")
    assert revision(old_url) == "0004" and op_rows(old_url) == keyed_by(op_key)
    _downgrade(old_url, "0003")
    assert revision(old_url) == "0003" and op_rows(old_url) == before


def test_an_old_stream_goes_on_in_new_records_and_reads_whole(old_url, capsys):
    """After init, a handle whose earlier records are indexed by kvl_record_streams gets a
    new record that points back to them (PREV_INDEXED): its stream reads old and new
    events in order, verify is clean, and a downgrade indexes the new record too."""
    from kvledger.journal.builders import guard_of, publish_op
    from kvledger.journal.keys import PREV_INDEXED, unpack_prev

    assert cli(capsys, "init", "--db", old_url)[0] == 0
    with open_journal(old_url) as journal:
        handle = next(iter(journal.heads()))
        before = journal.read_stream(handle)
        for n in range(3):
            journal.append([publish_op(handle, guard_of(journal.head(handle)), f"after-0006-{n}")])
        after = journal.read_stream(handle)
        assert after[:len(before)] == before and len(after) == len(before) + 3
        assert [e.stream_position for e in after] == list(range(1, len(after) + 1))
        assert journal.read_stream(handle, after=len(before) - 1) == after[len(before) - 1:]
    first_new = sql(old_url, "SELECT stream_prev FROM kvl_records WHERE stream_prev IS NOT NULL "
                             "ORDER BY last_position LIMIT 1")
    assert unpack_prev(bytes(first_new[0][0])) == [PREV_INDEXED]
    # (publish_op's bare publications after the handle's release are findings of their
    # own: only the storage's count here)
    code, out, err = cli(capsys, "verify", "--json", "--db", old_url)
    assert [f for f in json.loads(out)["findings"] if f["code"] == "TAMPERED"] == [], out + err
    _downgrade(old_url, "0005")
    rows = sql(old_url, "SELECT last_position FROM kvl_record_streams WHERE stream_key = :k ORDER BY last_position",
               k=stable_key(handle))
    assert len(rows) == len({r for r in rows}) and rows[-1][0] == after[-1].global_position
