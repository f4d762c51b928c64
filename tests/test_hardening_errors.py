"""Issue 17, classes 10, 12, 14 and 15: every database failure is one coded line with
exit 2 (never a traceback, never exit 1), migration states are refused or repaired
correctly, no message can be split into two lines, and a refused command creates no
database. Each case checks the journal is unchanged afterwards."""

from __future__ import annotations

import subprocess
import sys
import time

import psycopg
import pytest
from sqlalchemy.engine import make_url

from kvledger import Ledger, migrations
from kvledger.journal.contract import ImportTables
from kvledger.journal.tables import REVISIONS, SCHEMA_REVISION
from kvledger.migrations.storage import init_database, open_or_create_journal
from kvledger.schemas.errors import ErrorCode, KvLedgerError, one_line

from factories import allocate_op
from hardening_db import ROOT, cli, cli_process, execute, refused, snapshot

READ_COMMANDS = [["verify"], ["replay"], ["export", "--out", "-"], ["recover", "--no-continue"]]


def _journal_with_events(db_url: str) -> str:
    with open_or_create_journal(db_url) as j:
        j.append([allocate_op("A", "op-a"), allocate_op("B", "op-b")])
    return db_url


# -- class 10: driver errors -----------------------------------------------------------

@pytest.mark.parametrize("kind, code", [
    ("directory", "NOT_A_DATABASE"), ("text", "NOT_A_DATABASE"), ("png", "NOT_A_DATABASE"),
    ("truncated", "NOT_A_DATABASE"),
])
def test_a_file_that_is_not_a_journal_is_refused_by_every_command(tmp_path, kind, code):
    path = tmp_path / "j.db"
    if kind == "directory":
        path.mkdir()
    elif kind == "text":
        path.write_text("hello\nworld\n")
    elif kind == "png":
        path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(500))
    else:  # a real journal cut short: a header that promises pages that are not there
        init_database(f"sqlite:///{tmp_path}/full.db")
        path.write_bytes((tmp_path / "full.db").read_bytes()[:100] + b"\x01" * 924)
    url = f"sqlite:///{path}"
    before = snapshot(url) if path.is_file() else None
    for cmd in [*READ_COMMANDS, ["init"], ["import", str(tmp_path / "none.jsonl")]]:
        refused(cli(*cmd, "--db", url), code if cmd[0] != "import" else "INVALID_ARGUMENT")
        assert (snapshot(url) if path.is_file() else None) == before
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("j.db")) == ["j.db"]
    with pytest.raises(KvLedgerError) as info:
        Ledger.open(url)
    assert info.value.code.value == code


def test_a_read_only_directory_and_file_are_coded(tmp_path):
    """chattr +i makes a directory or file immutable even for root (these tests run as root)."""
    ro_dir, ro_file_dir = tmp_path / "ro", tmp_path / "rofile"
    ro_dir.mkdir()
    ro_file_dir.mkdir()
    init_database(f"sqlite:///{ro_dir}/j.db")
    init_database(f"sqlite:///{ro_file_dir}/j.db")
    _journal_with_events(f"sqlite:///{ro_file_dir}/j.db")
    verified = cli("verify", "--db", f"sqlite:///{ro_file_dir}/j.db", "--json")
    if subprocess.run(["chattr", "+i", str(ro_dir), str(ro_file_dir / "j.db")]).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        before = snapshot(f"sqlite:///{ro_file_dir}/j.db")
        refused(cli("verify", "--db", f"sqlite:///{ro_dir}/j.db"), "DATABASE_READ_ONLY")
        refused(cli("init", "--db", f"sqlite:///{ro_dir}/new.db"), "DATABASE_READ_ONLY")
        refused(cli("import", "--db", f"sqlite:///{ro_dir}/new.db", __file__), "DATABASE_READ_ONLY")
        with pytest.raises(KvLedgerError) as info:
            Ledger.open(f"sqlite:///{ro_dir}/other.db")
        assert info.value.code is ErrorCode.DATABASE_READ_ONLY
        # an immutable journal file in a writable directory: reading works, writing is coded
        assert cli("verify", "--db", f"sqlite:///{ro_file_dir}/j.db", "--json") == verified
        refused(cli("replay", "--db", f"sqlite:///{ro_file_dir}/j.db", "--incremental"), "DATABASE_READ_ONLY")
        with open_or_create_journal(f"sqlite:///{ro_file_dir}/j.db") as j, pytest.raises(KvLedgerError) as info:
            j.append([allocate_op("C", "op-c")])
        assert info.value.code is ErrorCode.DATABASE_READ_ONLY
        assert snapshot(f"sqlite:///{ro_file_dir}/j.db")["j.db"] == before["j.db"]
        assert sorted(p.name for p in ro_dir.iterdir()) == ["j.db"]
    finally:
        subprocess.run(["chattr", "-i", str(ro_dir), str(ro_file_dir / "j.db")], check=True)


@pytest.mark.parametrize("url", ["sqlite://x", "sqlite://x/j.db", "sqlite:///{tmp}/j.db?timeout=abc",
                                 "sqlite:///{tmp}/j.db?bogus=1", "sqlite:///{tmp}/nodir/j.db"])
def test_malformed_sqlite_urls_are_bad_database_url(tmp_path, url):
    url = url.format(tmp=tmp_path)
    for cmd in [*READ_COMMANDS, ["init"]]:
        refused(cli(*cmd, "--db", url), "BAD_DATABASE_URL")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def dead_and_wrong(pg_admin, tmp_path):
    """A PostgreSQL URL whose server is not there, and one whose database does not exist."""
    u = make_url(pg_admin.admin_url)
    dead = u.update_query_dict({"port": "1"}) if "port" in u.query else u.set(port=1)  # libpq's ?host=/dir&port=
    return (dead.set(database="kvl").render_as_string(hide_password=False),
            u.set(database="kvl_no_such_db").render_as_string(hide_password=False))


def test_every_command_codes_an_unreachable_or_missing_postgres(dead_and_wrong, tmp_path):
    dead, missing = dead_and_wrong
    jsonl = tmp_path / "x.jsonl"
    jsonl.write_text("")
    telemetry = tmp_path / "t.jsonl"
    telemetry.write_text("")
    commands = [*READ_COMMANDS, ["init"], ["import", str(jsonl)], ["reconcile", "--telemetry", str(telemetry)],
                ["demo", "--requests", "1", "--max-new-tokens", "1"], ["generate", "--prompt-ids", "1,2"],
                ["crash-test", "--trials", "1"]]
    for cmd in commands:
        refused(cli(*cmd, "--db", dead), "DATABASE_UNREACHABLE")
        refused(cli(*cmd, "--db", missing), "DATABASE_NOT_FOUND")
    # and through a real process: exit 2, one line, not a traceback with exit 1
    refused(cli_process("verify", "--db", dead), "DATABASE_UNREACHABLE")
    with pytest.raises(KvLedgerError) as info:
        Ledger.open(dead)
    assert info.value.code is ErrorCode.DATABASE_UNREACHABLE


@pytest.mark.sql_storage("SQL constraint errors and a dropped SQL table")
def test_value_too_long_constraint_and_dropped_table_have_their_own_codes(db_url, backend):
    _journal_with_events(db_url)
    before = snapshot(db_url)
    with open_or_create_journal(db_url) as j:
        with pytest.raises(KvLedgerError) as info:  # refused before PostgreSQL's column would
            j.append([allocate_op("H" * 300, "op-long")])
        assert info.value.code is ErrorCode.FIELD_TOO_LARGE
        events = [(e, body) for e, body in zip(j.read_all(), (b for _, b in j.read_raw()))]
    # a constraint: two events with one event id, loaded into an empty journal
    empty = db_url.replace("journal.db", "empty.db") if backend == "sqlite" else None
    if empty is not None:
        init_database(empty)
        with open_or_create_journal(empty) as target, pytest.raises(KvLedgerError) as info:
            target.import_events([events[0], events[0]], lambda: ImportTables({}, []))
        assert info.value.code is ErrorCode.CONSTRAINT_VIOLATION
    assert snapshot(db_url) == before
    execute(db_url, "DROP TABLE kvl_heads")
    before = snapshot(db_url)
    line = refused(cli("verify", "--db", db_url), "TABLE_MISSING")
    assert "journal table is missing" in line
    assert snapshot(db_url) == before


def test_a_driver_error_that_escapes_every_boundary_is_still_one_line(monkeypatch):
    """The CLI's last resort: a psycopg error raised where no journal boundary caught it
    is translated (its text, which quotes a password, is not shown); any other exception
    is one INTERNAL_ERROR line."""
    import kvledger.migrations.storage as storage  # what `verify` opens its journal with

    def leak(_args):
        raise psycopg.OperationalError('connection failed: password "Zq7XkPw2" rejected')

    monkeypatch.setattr(storage, "open_existing_journal", lambda *_: leak(None))
    line = refused(cli("verify", "--db", "postgresql+psycopg://u@127.0.0.1:1/x"), "DATABASE_UNREACHABLE",
                   "Zq7XkPw2")
    assert line.startswith("DATABASE_UNREACHABLE: PostgreSQL at 127.0.0.1:1, database x:")

    def bug(*_):
        raise TypeError("Zq7XkPw2 in a bug's message")

    monkeypatch.setattr(storage, "open_existing_journal", bug)
    line = refused(cli("verify", "--db", "sqlite:///x.db"), "INTERNAL_ERROR", "Zq7XkPw2")
    assert "TypeError" in line and "KVLEDGER_DEBUG=1" in line


# -- class 12: migration states --------------------------------------------------------

def test_known_revisions_are_alembic_s():
    assert migrations.known_revisions() == REVISIONS and REVISIONS[-1] == SCHEMA_REVISION


@pytest.mark.sql_storage("edits alembic's version table of a SQL journal")
def test_a_newer_revision_is_refused_by_every_command(db_url):
    _journal_with_events(db_url)
    execute(db_url, "UPDATE kvl_alembic_version SET version_num = '9999_future'")
    before = snapshot(db_url)
    for cmd in [*READ_COMMANDS, ["init"], ["demo", "--requests", "1", "--max-new-tokens", "1"]]:
        line = refused(cli(*cmd, "--db", db_url), "DATABASE_TOO_NEW")
        assert "written by a newer kvledger" in line and "9999_future" in line
    with pytest.raises(KvLedgerError) as info:
        Ledger.open(db_url)
    assert info.value.code is ErrorCode.DATABASE_TOO_NEW
    assert snapshot(db_url) == before


@pytest.mark.sql_storage("edits alembic's version table of a SQL journal")
def test_an_emptied_version_table_is_refused_then_repaired_by_init(db_url):
    _journal_with_events(db_url)
    events = snapshot(db_url) if db_url.startswith("postgres") else None
    verified = cli("verify", "--db", db_url, "--json")
    execute(db_url, "DELETE FROM kvl_alembic_version")
    before = snapshot(db_url)
    for cmd in [*READ_COMMANDS, ["demo", "--requests", "1", "--max-new-tokens", "1"]]:
        line = refused(cli(*cmd, "--db", db_url), "NOT_MIGRATED")
        assert "no recorded revision" in line and "kvledger init" in line
    assert snapshot(db_url) == before
    # init sees the tables are exactly head's and records head: nothing else changes
    assert cli("init", "--db", db_url)[0] == 0
    assert cli("verify", "--db", db_url, "--json") == verified and '"events":2' in verified[1]
    if events is not None:
        assert snapshot(db_url) == events


@pytest.mark.sql_storage("edits alembic's version table of a SQL journal")
def test_an_emptied_version_table_with_other_tables_is_a_schema_mismatch(db_url):
    _journal_with_events(db_url)
    execute(db_url, "DELETE FROM kvl_alembic_version", "DROP TABLE kvl_checkpoints")
    before = snapshot(db_url)
    refused(cli("init", "--db", db_url), "SCHEMA_MISMATCH")
    with pytest.raises(KvLedgerError) as info:
        Ledger.open(db_url)
    assert info.value.code is ErrorCode.NOT_MIGRATED
    assert snapshot(db_url) == before


_RACER = """
import sys, time
from kvledger import Ledger
from kvledger.migrations.storage import init_database
url, how, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
time.sleep(max(0.0, start - time.time() - 0.01))  # asleep, not spinning: four racers share two cores
while time.time() < start:
    pass
if how == "init":
    init_database(url)
else:
    with Ledger.open(url) as ledger:
        ledger.journal.last_position()
print("ok")
"""


def test_processes_initializing_one_new_sqlite_file_at_once_all_succeed(tmp_path):
    for trial in range(3):
        url = f"sqlite:///{tmp_path}/race{trial}.db"
        start = time.time() + 2.0  # every process imported and waiting by then
        procs = [subprocess.Popen([sys.executable, "-c", _RACER, url, how, str(start)], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for how in ("init", "open", "init", "open")]
        results = [p.communicate(timeout=120) for p in procs]
        assert all(p.returncode == 0 and out.strip() == "ok" for p, (out, _) in zip(procs, results)), results
        rc, out, _ = cli("verify", "--db", url, "--json")
        assert rc == 0 and '"events":0' in out


def test_concurrent_init_of_a_new_postgres_database(pg_admin):
    url = pg_admin.create(migrated=False)
    start = time.time() + 2.0
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, url, "init", str(start)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    assert cli("verify", "--db", url)[0] == 0


# -- class 14: one line, whatever the input ---------------------------------------------

def test_control_characters_cannot_forge_a_second_line(tmp_path, db_url):
    fake = "x\nSTALE_BASE: forged\r\u2028\u0085\x1b[2K"
    assert "\n" not in one_line(fake) and "\r" not in one_line(fake) and "\u2028" not in one_line(fake)
    # a path (CLI), an id (API), an audit file name
    refused(cli("verify", "--db", f"sqlite:///{tmp_path}/{fake}/j.db"), "BAD_DATABASE_URL")
    refused(cli("replay", "--db", f"sqlite:///{tmp_path}/{fake}.db"), "DATABASE_NOT_FOUND")
    line = refused(cli("verify", "--journal", str(tmp_path / fake)), "INVALID_ARGUMENT")
    assert "\\nSTALE_BASE: forged\\r\\u2028\\x85\\x1b[2K" in line
    with Ledger.open(db_url) as ledger, pytest.raises(KvLedgerError) as info:
        ledger.state(fake)
    assert info.value.code is ErrorCode.UNKNOWN_HANDLE and len(str(info.value).splitlines()) == 1
    assert info.value.message.endswith(fake)  # the raw text stays available to JSON


# -- class 15: a refused command creates nothing -----------------------------------------

def test_refused_commands_create_no_database(tmp_path):
    new = tmp_path / "new.db"
    url = f"sqlite:///{new}"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"event_type": "nope"}\n')
    for cmd, code in [(["replay"], "DATABASE_NOT_FOUND"), (["replay", "--incremental"], "DATABASE_NOT_FOUND"),
                      (["verify"], "DATABASE_NOT_FOUND"), (["export", "--out", "-"], "DATABASE_NOT_FOUND"),
                      (["recover"], "DATABASE_NOT_FOUND"),
                      (["reconcile", "--telemetry", str(bad)], "DATABASE_NOT_FOUND"),
                      (["import", str(bad)], None), (["import", str(tmp_path / "none.jsonl")], None),
                      (["demo", "--metrics-port", "70000"], "INVALID_ARGUMENT"),
                      (["demo", "--telemetry", str(tmp_path / "no" / "t.jsonl")], "UNWRITABLE_OUTPUT"),
                      (["demo", "--requests", "0"], "INVALID_ARGUMENT"),
                      (["generate", "--prompt-ids", "x"], "INVALID_ARGUMENT")]:
        rc, out, err = cli(*cmd, "--db", url)
        assert rc == 2 and len(err.splitlines()) == 1 and (code is None or err.startswith(code)), (cmd, err)
        assert list(tmp_path.iterdir()) == [bad], (cmd, list(tmp_path.iterdir()))


def test_import_into_a_new_file_appears_only_when_complete(tmp_path, db_url, backend):
    if backend != "sqlite":
        pytest.skip("the new-file rule is SQLite's")
    _journal_with_events(db_url)
    out = tmp_path / "x.jsonl"
    assert cli("export", "--db", db_url, "--out", str(out))[0] == 0
    target = tmp_path / "imported.db"
    rc, stdout, _ = cli("import", "--db", f"sqlite:///{target}", str(out))
    assert rc == 0 and str(target) in stdout
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".creating")]
    rc, stdout, _ = cli("verify", "--db", f"sqlite:///{target}", "--json")
    assert rc == 0 and '"events":2' in stdout
