"""Helpers for tests that damage a journal the way an operator or a disk would: edit rows
through the database directly, and take a full picture of a journal to prove that a
refused command changed nothing."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path
from typing import NamedTuple

import msgspec
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from kvledger import migrations
from kvledger.cli import main
from kvledger.journal import make_engine, open_journal, parse_url
from kvledger.journal.blocks import pack
from kvledger.journal.connection import PG_CONNECT_TIMEOUT_S
from kvledger.journal.contract import Operation
from kvledger.journal.steps import StepReader, StepWriter
from kvledger.journal.tables import JOURNAL_TABLES as TABLES
from kvledger.migrations.storage import open_or_create_journal
from kvledger.replay import import_jsonl
from kvledger.schemas.codec import encode_event

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def old_journal(request: pytest.FixtureRequest, tmp_path: Path, fixture: Path, revision: str,
                tables: tuple[str, ...]) -> str:
    """A writable copy of an old journal fixture (`fixture`/journal.db, at `revision`) on
    the backend `request.param` names. On PostgreSQL: a database migrated to `revision`
    with the same rows of `tables` (the old code wrote the same row values on both
    backends: one codec)."""
    if request.param == "sqlite":
        shutil.copy(fixture / "journal.db", tmp_path / "journal.db")
        return f"sqlite:///{tmp_path}/journal.db"
    url: str = request.getfixturevalue("pg_admin").create(migrated=False)
    engine = make_engine(parse_url(url))
    migrations.upgrade(engine, revision)
    src = sqlite3.connect(fixture / "journal.db")
    try:
        with engine.begin() as conn:
            for table in tables:  # constant names
                cols = [r[1] for r in src.execute(f"PRAGMA table_info({table})")]
                rows = [dict(zip(cols, r, strict=True)) for r in src.execute(f"SELECT * FROM {table}")]
                if rows:
                    conn.exec_driver_sql(
                        f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join(f'%({c})s' for c in cols)})",
                        rows)
    finally:
        src.close()
        engine.dispose()
    return url


def sql(db_url: str, statement: str, **params) -> list[tuple]:
    """Run one statement with bound parameters in its own transaction; its rows, if any."""
    with _engine(db_url).begin() as conn:
        result = conn.execute(text(statement), params)
        return [tuple(r) for r in result] if result.returns_rows else []


_ENGINES: dict[str, Engine] = {}


def _engine(db_url: str) -> Engine:
    """The last URL's engine, kept: on PostgreSQL one session serves a test's statements
    (a connection a statement cost tests/test_tamper.py a third of its time)."""
    if db_url not in _ENGINES:
        close_sessions()
        url = parse_url(db_url)
        # pre-ping: a test may have restarted the server or dropped the session under it
        _ENGINES[db_url] = make_engine(url) if url.drivername.startswith("sqlite") else \
            create_engine(url, pool_size=1, pool_pre_ping=True, connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S})
    return _ENGINES[db_url]


def close_sessions() -> None:
    """Close the session `sql` keeps (before a database is copied: CREATE DATABASE ...
    TEMPLATE refuses a template with a session open)."""
    for engine in _ENGINES.values():
        engine.dispose()
    _ENGINES.clear()


_HEAD_FACTS = ("request_id, generation, snapshot_version, stream_position, committed_length, lifecycle, "
               "prefix_identity_sha256, cache_abi_sha256, last_record")  # kvl_heads but its key


def copy_head(db_url: str, handle: str, as_handle: str) -> None:
    """A head row for `as_handle` copied from `handle`'s (a head no stream of events leads
    to: what a deleted record leaves, written by hand)."""
    sql(db_url, f"INSERT INTO kvl_heads (handle_id, {_HEAD_FACTS}) SELECT :new, {_HEAD_FACTS} "  # constant columns
        "FROM kvl_heads WHERE handle_id = :old", new=as_handle, old=handle)


class StoredRecord(NamedTuple):
    last: int  # its last global position
    first: int
    body: bytes
    chain: bytes  # the chain digest through it


def _small_demo(url: str) -> None:
    assert main(["demo", "--requests", "2", "--db", url, "--json"]) == 0


def demo_records(shared_journal) -> tuple[str, list[tuple[int, int, bytes]]]:
    """A two-request demo journal, built once per backend and test process for the tests
    that damage its records one at a time and put each back: (url, records as (last,
    first, body))."""
    url = shared_journal("small-demo", _small_demo)
    return url, [(r.last, r.first, r.body) for r in records(url)]


def records(db_url: str) -> list[StoredRecord]:
    """Every stored record, in order, as the backend stores it: kvl_records' rows on SQL,
    the record messages of a NATS cell (their positions and chain in headers)."""
    if db_url.startswith("nats"):
        return [StoredRecord(int(h["Kvl-Last"]), int(h["Kvl-First"]), data, bytes.fromhex(h["Kvl-Chain"]))
                for _, subject, headers, data in nats_messages(db_url) if subject.endswith(".r")
                for h in [dict(headers)]]
    rows = sql(db_url, "SELECT last_position, first_position, body, chain FROM kvl_records ORDER BY last_position")
    return [StoredRecord(last, first, bytes(body), bytes(chain)) for last, first, body, chain in rows]


def dump(db_url: str) -> dict[str, list[tuple]]:
    """Every row of every journal table, in a fixed order, with SQLite's storage type of
    each value (a TEXT '7' is not an INTEGER 7)."""
    out = {}
    for table in TABLES:  # constant names
        rows = sql(db_url, f"SELECT * FROM {table}")
        out[table] = sorted(tuple((type(v).__name__, bytes(v) if isinstance(v, memoryview) else v)
                                  for v in r) for r in rows)
    return out


def nats_messages(db_url: str) -> list[tuple[int, str, tuple[tuple[str, str], ...], bytes]]:
    """Every message of a NATS cell's stream, in stream order: (sequence, subject,
    headers, data). The stream denies delete and purge, so these are all it stores."""
    from kvledger.journal.nats import NatsJournal
    from kvledger.journal.nats_client import GET_BATCH

    with NatsJournal(db_url) as j:
        end = int((j.client.api(f"STREAM.INFO.{j.stream}").get("state") or {}).get("last_seq", 0))
        out: list[tuple[int, str, tuple[tuple[str, str], ...], bytes]] = []
        while len(out) < end:
            page = j.client.get_many(j.stream, {"seq": len(out) + 1, "batch": GET_BATCH, "up_to_seq": end})
            assert page and page[0].seq == len(out) + 1, "a gap in a stream that denies delete"
            out += [(m.seq, m.subject, tuple(sorted(m.headers.items())), m.data) for m in page]
        return out


def picture(db_url: str) -> object:
    """What must not change: the database file's bytes on SQLite (with no WAL left
    behind), the full dump on PostgreSQL, every stored message on NATS."""
    if db_url.startswith("nats"):
        return nats_messages(db_url)
    if db_url.startswith("sqlite"):
        path = Path(db_url.removeprefix("sqlite:///"))
        wal = path.with_name(path.name + "-wal")
        return path.read_bytes(), wal.exists() and wal.stat().st_size > 0
    return dump(db_url)


def imported(db_url: str, name: str = "two_request_trajectory") -> dict:
    """Import a fixture journal; its events by global position."""
    with open_or_create_journal(db_url) as journal:
        import_jsonl(journal, FIXTURES / f"{name}.jsonl")
        return {e.global_position: e for e in journal.read_all()}


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def reads_as_recorded(capsys, url: str, fixture: Path, out_dir: Path, receipts: list | None = None) -> None:
    """`verify --json` (clean, apart from where it ran), `replay --json` and `export` of
    the journal at `url` print what the old code printed into `fixture`; and each of
    the old code's `receipts` is found by its operation id."""
    code, out, err = cli(capsys, "verify", "--json", "--db", url)
    assert code == 0, err
    got, want = json.loads(out), json.loads((fixture / "verify.json").read_text())
    skip = {"source", "storage"}
    assert got["ok"] and {k: v for k, v in got.items() if k not in skip} == \
        {k: v for k, v in want.items() if k not in skip}
    code, out, err = cli(capsys, "replay", "--json", "--db", url)
    assert code == 0 and out == (fixture / "replay.json").read_text(), err
    assert cli(capsys, "export", "--db", url, "--out", str(out_dir / "e.jsonl"))[0] == 0
    assert (out_dir / "e.jsonl").read_bytes() == (fixture / "export.jsonl").read_bytes()
    if receipts is not None:
        with open_journal(url) as journal:
            assert [journal.receipt(r.operation_id) for r in receipts] == receipts


def one_coded_line(err: str, code: str | None = None) -> str:
    """The single stderr line of a refused command, asserted to carry a stable code."""
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    head = lines[0].split(":", 1)[0]
    assert head.isupper() and head.replace("_", "").isalpha(), err
    if code is not None:
        assert head == code, err
    return lines[0]


def assert_row_rebuilds(op: Operation) -> None:
    """A stamped decode step (the service's lane) is a row that rebuilds its events byte
    for byte. Its ids are put in engine.ids' form first (a seeded test draws uuid4s)."""
    prefix = "0123456789abcdef"
    w = op.writes[0]
    events = [msgspec.structs.replace(e, event_id=f"{prefix}{k + 2:016x}", operation_id=f"{prefix}{1:016x}")
              for k, e in enumerate(w.events)]
    p, o, s = events
    call = s.payload.call
    events = [
        msgspec.structs.replace(p, payload=msgspec.structs.replace(p.payload, txn_id=f"{prefix}{100:016x}")), o,
        msgspec.structs.replace(s, payload=msgspec.structs.replace(s.payload, txn_id=f"{prefix}{101:016x}", call=(
            call and msgspec.structs.replace(call, call_id=f"{prefix}{102:016x}"))))]
    op = msgspec.structs.replace(op, operation_id=f"{prefix}{1:016x}",
                                 writes=(msgspec.structs.replace(w, events=tuple(events)),))
    writer = StepWriter(1, 0)
    row = writer.row(op)
    assert row is not None
    rebuilt = StepReader(writer.context()).block(pack([row]), 0, False).events()
    assert [encode_event(e) for e in rebuilt] == [
        encode_event(msgspec.structs.replace(e, global_position=1 + k)) for k, e in enumerate(events)]
