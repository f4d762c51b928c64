"""Issue 17, verify: indexed columns agree with bodies (3), the database's own integrity
check (5), one snapshot while a writer runs (6), malformed stored data is a finding that
names its row (11), bounded findings and input (18). Real databases, real damage."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest

from kvledger import Ledger
from kvledger.journal import open_journal
from kvledger.replay import verify_journal
from kvledger.replay.stored import EVENT_COLUMNS

from stored_rows import FIXTURES, cli, imported, one_coded_line, sql

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def findings(db_url: str):
    with open_journal(db_url) as journal:
        return verify_journal(journal).findings


# -- 3: every indexed column is checked against its body ------------------------------

def _edit(column: str, e) -> tuple[str, dict]:
    """An UPDATE changing `column` of the row of event `e` to a plausible other value."""
    g = e.global_position
    new = {
        "global_position": g + 1000,
        "event_id": e.event_id + "x",
        "stream_id": e.stream_id + "x",
        "stream_position": e.stream_position + 1000,
        "event_type": "release" if e.event_type != "release" else "finish",
        "schema_version": e.schema_version + 1,
        "operation_id": "forged-op" if e.operation_id is None else None,
    }[column]
    # the column name comes from the constant EVENT_COLUMNS, the values are bound
    return f"UPDATE kvl_events SET {column} = :v WHERE global_position = :g", {"v": new, "g": g}


def _sql_pair(db_url: str, pair: tuple[str, dict]) -> None:
    sql(db_url, pair[0], **pair[1])


def _restore(column: str, e) -> tuple[str, dict]:
    g = e.global_position
    if column == "global_position":
        return "UPDATE kvl_events SET global_position = :g WHERE global_position = :m", {"g": g, "m": g + 1000}
    return (f"UPDATE kvl_events SET {column} = :v WHERE global_position = :g",
            {"v": getattr(e, column), "g": g})


@pytest.mark.sql_storage("edits SQL rows in place: a NATS stream has no rows to edit")
@pytest.mark.parametrize("column", EVENT_COLUMNS)
def test_an_edited_column_of_any_event_is_named(db_url, column, capsys):
    events = imported(db_url)
    assert findings(db_url) == []
    for g, e in events.items():
        _sql_pair(db_url, _edit(column, e))
        hits = [f for f in findings(db_url) if f.code == "COLUMN_MISMATCH"]
        assert hits and hits[0].global_position == g and hits[0].event_id == e.event_id, (g, hits)
        assert f"column {column} " in hits[0].message
        _sql_pair(db_url, _restore(column, e))
    assert findings(db_url) == []
    _sql_pair(db_url, _edit(column, events[7]))
    code, out, err = cli(capsys, "verify", "--db", db_url, "--json")
    report = json.loads(out)
    assert code == 1 and err == "" and not report["ok"]
    assert [f["global_position"] for f in report["findings"] if f["code"] == "COLUMN_MISMATCH"] == [7]


@pytest.mark.sql_storage("edits SQL rows in place: a NATS stream has no rows to edit")
def test_a_column_edit_that_changes_state_is_caught(db_url):
    """Reads select by the columns: moving an emit to another stream changes what
    Ledger.state() returns, and verify names exactly that event."""
    events = imported(db_url)
    emit = next(e for e in events.values() if e.event_type == "output_emit" and e.stream_id == "B")
    with Ledger.open(db_url) as led:
        before = led.state("B").outputs
    sql(db_url, "UPDATE kvl_events SET stream_position = stream_position + 100 WHERE global_position = :g",
        g=emit.global_position)
    with Ledger.open(db_url) as led:
        assert led.state("B").outputs != before  # the damage is real
    [f] = findings(db_url)
    assert (f.code, f.global_position, f.stream_id) == ("COLUMN_MISMATCH", emit.global_position, "B")


@pytest.mark.sql_storage("edits SQL rows in place: a NATS stream has no rows to edit")
def test_pages_of_one_snapshot_cover_every_row(db_url, monkeypatch):
    """Events and receipts are read in keyset pages inside the snapshot: with pages of 2
    rows, every row is still read exactly once, and a damaged one on a page edge is named."""
    from kvledger.journal import snapshot

    events = imported(db_url)
    monkeypatch.setattr(snapshot, "PAGE", 2)
    with open_journal(db_url) as j:
        result = verify_journal(j)
    assert result.ok and result.events == len(events) == 21
    sql(db_url, "UPDATE kvl_receipts SET fingerprint = 'x' WHERE operation_id = :o", o=events[8].operation_id)
    sql(db_url, "UPDATE kvl_events SET event_type = 'reorder' WHERE global_position = 20")
    got = {(f.code, f.global_position) for f in findings(db_url)}
    assert got == {("RECEIPT_MISMATCH", 8), ("COLUMN_MISMATCH", 20)}


@pytest.mark.sql_storage("edits SQL rows in place: a NATS stream has no rows to edit")
def test_a_row_moved_below_position_one_is_still_read(db_url):
    events = imported(db_url)
    sql(db_url, "UPDATE kvl_events SET global_position = -5 WHERE global_position = 9")
    hits = [f for f in findings(db_url) if f.code == "COLUMN_MISMATCH"]
    assert [(f.global_position, f.event_id) for f in hits] == [(9, events[9].event_id)]


@pytest.mark.sql_storage("edits SQL rows in place: a NATS stream has no rows to edit")
@pytest.mark.parametrize("column, value", [("fingerprint", "forged"), ("first_global_position", 2),
                                           ("last_global_position", 99), ("operation_id", "other-op")])
def test_an_edited_receipt_column_is_named(db_url, column, value):
    events = imported(db_url)
    target = events[8]
    sql(db_url, f"UPDATE kvl_receipts SET {column} = :v WHERE operation_id = :o", v=value,
        o=target.operation_id)
    hits = [f for f in findings(db_url) if f.code == "RECEIPT_MISMATCH" and f"column {column} " in f.message]
    assert hits, findings(db_url)
    assert hits[0].global_position == (2 if column == "first_global_position" else 8)


@pytest.mark.sql_storage("edits SQL rows in place: a NATS stream has no rows to edit")
def test_an_edited_head_request_id_is_named(db_url):
    events = imported(db_url)
    sql(db_url, "UPDATE kvl_heads SET request_id = 'Z' WHERE handle_id = 'A'")
    [f] = findings(db_url)
    last_a = max(p for p, e in events.items() if e.stream_id == "A")
    assert (f.code, f.global_position, f.stream_id) == ("HEAD_MISMATCH", last_a, "A")


# -- 5: the database's own integrity check --------------------------------------------

def _sqlite_file(db_url: str) -> Path:
    return Path(db_url.removeprefix("sqlite:///"))


def test_every_zeroed_sqlite_page_is_found(tmp_path, capsys):
    """Zero each page of a small journal in turn: verify exits 1 with STORAGE_CORRUPT from
    quick_check. The exceptions are the pages of SQLite's own schema (beyond the first
    page's share, with 1 KB pages) and the schema version's page: without them the
    database cannot be opened as a journal at all, which is one coded line and exit 2.
    Never a clean exit 0, never a traceback."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    from kvledger.migrations.storage import init_database

    init_database(url)
    imported(url)
    path = _sqlite_file(url)
    pristine = path.read_bytes()
    page_size = sql(url, "PRAGMA page_size")[0][0]
    assert sql(url, "PRAGMA freelist_count")[0][0] == 0  # every page is in use
    [(version_page,)] = sql(url, "SELECT rootpage FROM sqlite_master WHERE name = 'kvl_alembic_version'")
    unopenable = {version_page} | {p for (p,) in sql(url, "SELECT pageno FROM dbstat WHERE name = 'sqlite_schema'")}
    # quick_check walks the b-trees, not the overflow chains of long values (a body past
    # a 1 KB page's share): a zeroed one is found by reading what it held
    overflow = {p for (p,) in sql(url, "SELECT pageno FROM dbstat WHERE pagetype = 'overflow'")}
    pages = len(pristine) // page_size
    assert pages >= 16  # a root page per table and index, at least
    for n in range(2, pages + 1):  # page 1 is the file header: not a database at all
        path.write_bytes(pristine[:(n - 1) * page_size] + bytes(page_size) + pristine[n * page_size:])
        code, out, err = cli(capsys, "verify", "--db", url, "--json")
        if n in unopenable:
            assert code == 2 and out == "", (n, out)
            one_coded_line(err)
            continue
        assert code == 1 and err == "", (n, code, err)
        report = json.loads(out)
        assert not report["ok"] and report["storage"] == "sqlite quick_check"
        if n in overflow:
            assert {f["code"] for f in report["findings"]} & {"STORAGE_CORRUPT", "MALFORMED_EVENT",
                                                              "CORRUPT_JOURNAL", "TAMPERED"}, (n, report)
        else:
            assert "STORAGE_CORRUPT" in {f["code"] for f in report["findings"]}, (n, report)
    path.write_bytes(pristine)
    assert cli(capsys, "verify", "--db", url)[0] == 0


def test_sqlite_zeroed_index_page_names_the_check(tmp_path):
    url = f"sqlite:///{tmp_path / 'j.db'}"
    from kvledger.migrations.storage import init_database

    init_database(url)
    imported(url)
    [(root,)] = sql(url, "SELECT rootpage FROM sqlite_master WHERE name = 'kvl_events_operation_ix'")
    page_size = sql(url, "PRAGMA page_size")[0][0]
    path = _sqlite_file(url)
    data = bytearray(path.read_bytes())
    data[(root - 1) * page_size:root * page_size] = bytes(page_size)
    path.write_bytes(bytes(data))
    with open_journal(url) as journal:
        result = verify_journal(journal)
    assert result.storage == "sqlite quick_check"
    assert result.findings and {f.code for f in result.findings} == {"STORAGE_CORRUPT"}
    assert all(f.message.startswith("sqlite quick_check: ") for f in result.findings)


def test_postgres_runs_amcheck_when_installed_and_says_when_skipped(pg_admin, capsys):
    import psycopg

    from kvledger.journal.pgserver import conninfo

    url = pg_admin.create()
    imported(url)
    code, out, _ = cli(capsys, "verify", "--db", url, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and "skipped: the amcheck extension is not installed" in report["storage"]
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION amcheck")
    code, out, _ = cli(capsys, "verify", "--db", url, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"], report
    # every journal table and each of its btree indexes was checked
    assert report["storage"].startswith("amcheck: bt_index_check on ") and "skipped" not in report["storage"]
    indexes = int(report["storage"].split("bt_index_check on ")[1].split()[0])
    assert indexes >= 7


# -- 6: one snapshot while a writer runs ----------------------------------------------

WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from lifecycle_helpers import ManualClock
    from test_replay_workload import write_workload
    from kvledger import Ledger

    clock = ManualClock()
    with Ledger.open({url!r}, clock=clock) as led:
        seed = 0
        print("ready", flush=True)
        while True:
            seed += 1
            write_workload(led, clock, seed=seed, finish=seed % 2 == 0)
            time.sleep({pause})
""")


# The writer's pause between workloads; paced, it still commits beside every audit. Unpaced,
# SQLite's grew its journal to 21,000 events and its 20 audits (each reads all of it) to 25 s.
# A NATS audit reads each record over the network: at 0.2 s a loaded machine's journal grew
# to 2,700 events and held 18 audits in 60 s.
PAUSE = {"sqlite": 0.05, "postgres": 0.0, "nats": 0.4}


def test_verify_beside_a_running_writer_finds_nothing(backend, db_url):
    """Without one snapshot, about one audit in ten beside this writer read receipts or
    heads committed after its events (RECEIPT_MISMATCH, HEAD_MISMATCH); 8 s of audits
    make that near certain, so a pass means the reads really are one snapshot."""
    script = WRITER.format(tests=str(TESTS), url=db_url, pause=PAUSE[backend])
    writer = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready", writer.stderr.read()
        sizes = []
        with open_journal(db_url) as journal:
            # 8 s and 20 audits at least: on a slow machine 8 s held 18 (an audit's cost
            # grows with the journal), which says nothing about snapshots.
            start = time.monotonic()
            while time.monotonic() < start + 8 or (len(sizes) < 20 and time.monotonic() < start + 120):
                result = verify_journal(journal)
                assert result.ok, (len(sizes), result.findings[:5])
                sizes.append(result.events)
        assert writer.poll() is None, writer.stderr.read()
        print(f"audits: {len(sizes)}, journal sizes {sizes[0]}..{sizes[-1]}")
    finally:
        writer.kill()
        writer.wait()
    # the audits ran while the journal grew, each on a consistent journal
    assert len(sizes) >= 20 and sizes == sorted(sizes) and len(set(sizes)) >= 10, sizes


# -- 11: malformed stored data is a finding naming its row --------------------------------

DEEP = b'{"event_type":"finish","payload":' + b"[" * 200_000 + b"]" * 200_000 + b"}"


@pytest.mark.parametrize("body, code", [
    (DEEP, "MALFORMED_EVENT"),
    (b"[" * 200_000, "MALFORMED_EVENT"),
    (b'{"event_type":["finish"],"schema_version":1}', "MALFORMED_EVENT"),
    (b'{"event_type":{"a":1},"schema_version":1}', "MALFORMED_EVENT"),
    (b"\x00\xff junk \x01", "MALFORMED_EVENT"),
    (b'{"event_type":"finish","schema_version":99}', "UNKNOWN_SCHEMA_VERSION"),
])
@pytest.mark.sql_storage("edits SQL rows in place: a NATS stream has no rows to edit")
def test_an_undecodable_stored_body_is_named_by_its_row(db_url, capsys, body, code):
    imported(db_url)
    sql(db_url, "UPDATE kvl_events SET body = :b WHERE global_position = 6", b=body)
    got = findings(db_url)
    assert (got[0].code, got[0].global_position) == (code, 6), got[:3]
    rc, out, err = cli(capsys, "verify", "--db", db_url, "--json")
    assert rc == 1 and err == "" and json.loads(out)["findings"][0]["global_position"] == 6
    # reading commands refuse the row in one coded line instead of a traceback
    rc, _, err = cli(capsys, "replay", "--db", db_url)
    assert rc == 2 and "position 6" in one_coded_line(err, code)


def test_a_text_body_is_named_and_refused_by_readers(tmp_path, capsys):
    """SQLite stores whatever type a row is given: a body edited as TEXT."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    from kvledger.migrations.storage import init_database

    init_database(url)
    events = imported(url)
    sql(url, "UPDATE kvl_events SET body = CAST(body AS TEXT) WHERE global_position = 6")
    assert sql(url, "SELECT typeof(body) FROM kvl_events WHERE global_position = 6") == [("text",)]
    [f] = findings(url)
    assert (f.code, f.global_position) == ("STORED_TYPE_MISMATCH", 6) and "str" in f.message
    for args in (("replay", "--db", url), ("export", "--db", url, "--out", str(tmp_path / "x.jsonl"))):
        rc, _, err = cli(capsys, *args)
        assert rc == 2 and "position 6" in one_coded_line(err, "CORRUPT_JOURNAL")
    with Ledger.open(url) as led, pytest.raises(Exception) as exc:
        led.state(events[6].stream_id)
    assert getattr(exc.value, "code", None) is not None and exc.value.code.value == "CORRUPT_JOURNAL"


def test_a_text_position_is_named(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'j.db'}"
    from kvledger.migrations.storage import init_database

    init_database(url)
    events = imported(url)
    sql(url, "UPDATE kvl_events SET global_position = 'six' WHERE global_position = 6")
    hits = [f for f in findings(url) if f.code == "COLUMN_MISMATCH"]
    assert [(f.global_position, f.event_id) for f in hits] == [(6, events[6].event_id)]
    assert "'six'" in hits[0].message
    rc, _, err = cli(capsys, "replay", "--db", url)
    assert rc == 2 and "'six'" in one_coded_line(err, "CORRUPT_JOURNAL")


@pytest.mark.sql_storage("edits SQL rows in place: a NATS stream has no rows to edit")
@pytest.mark.parametrize("body", [b"\x00junk", b"[" * 100_000, b'{"operation_id":[1]}', b"{}"])
def test_a_junk_receipt_body_is_named(db_url, body):
    events = imported(db_url)
    sql(db_url, "UPDATE kvl_receipts SET body = :b WHERE operation_id = :o", b=body,
        o=events[8].operation_id)
    [f] = findings(db_url)  # damaged, so not also reported missing
    assert (f.code, f.global_position) == ("MALFORMED_RECEIPT", 8)


# -- 18: bounded findings, bounded input ---------------------------------------------

def _verify_child(tmp_path, *args: str, timeout: float = 120) -> tuple[int, str, float, int]:
    """`kvledger verify` in a child process: exit code, stdout, seconds, peak RSS (KiB).
    The peak is VmHWM of the child's own memory map: getrusage's ru_maxrss would carry
    over the forking pytest process's peak across exec."""
    rss = tmp_path / "rss"
    code = ("import re, sys\n"
            "from kvledger.cli import main\n"
            "rc = main(sys.argv[2:])\n"
            "status = open('/proc/self/status').read()\n"
            "open(sys.argv[1], 'w').write(re.search(r'VmHWM:\\s+(\\d+) kB', status).group(1))\n"
            "sys.exit(rc)\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code, str(rss), "verify", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert done.stderr == "", done.stderr
    return done.returncode, done.stdout, time.monotonic() - start, int(rss.read_text())


def test_200k_junk_lines_are_counted_not_listed(tmp_path):
    junk = tmp_path / "junk.jsonl"
    junk.write_bytes(b"".join(b"not an event %d\n" % i for i in range(200_000)))
    rc, out, seconds, rss_kib = _verify_child(tmp_path, "--journal", str(junk))
    assert rc == 1
    assert "... and 9900 more finding(s) not shown" in out
    assert "stopped at line 10000 after 10000 findings" in out
    assert len(out.splitlines()) < 130  # a table of 100 rows, not 200,000
    assert seconds < 60 and rss_kib < 300_000, (seconds, rss_kib)  # was 97 s and 838 MB


def test_verify_ends_on_endless_input(tmp_path):
    rc, out, seconds, rss_kib = _verify_child(tmp_path, "--journal", "/dev/urandom", "--json")
    report = json.loads(out)
    assert rc == 1 and not report["ok"] and len(report["findings"]) == 100
    assert report["omitted"] == 9900  # blank lines are skipped, so the line number is larger
    assert re.fullmatch(r"stopped at line \d+ after 10000 findings; the rest was not read", report["stopped"])
    assert seconds < 60 and rss_kib < 300_000, (seconds, rss_kib)
    rc, out, seconds, rss_kib = _verify_child(tmp_path, "--journal", "/dev/zero", "--json")
    report = json.loads(out)  # no newline ever: the line bound ends it
    assert rc == 1 and [f["code"] for f in report["findings"]] == ["FIELD_TOO_LARGE"]
    assert report["findings"][0]["line"] == 1 and "longer than" in report["stopped"]
    assert seconds < 60 and rss_kib < 400_000, (seconds, rss_kib)  # one bounded line (64 MiB) at most


def test_max_findings_shows_that_many_and_counts_the_rest(tmp_path, capsys):
    lines = (FIXTURES / "two_request_trajectory.jsonl").read_bytes().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(lines) + b"junk\n" * 50)
    rc, out, _ = cli(capsys, "verify", "--journal", str(bad), "--json", "--max-findings", "3")
    report = msgspec.json.decode(out)
    assert rc == 1 and [f["line"] for f in report["findings"]] == [22, 23, 24]
    assert report["omitted"] == 47 and report["stopped"] is None
    # refused when parsed, in one coded line like every checked argument, not argparse's usage
    for wrong, why in (("-1", "is outside [0, 10000]"), ("10001", "is outside [0, 10000]"),
                       ("x", "is not an integer"), ("1.5", "is not an integer")):
        rc, out, err = cli(capsys, "verify", "--journal", str(bad), "--max-findings", wrong)
        assert rc == 2 and out == "" and why in one_coded_line(err, "INVALID_ARGUMENT"), err


@pytest.mark.parametrize("argv", [
    ["verify", "--max-findings", "-1"],
    ["verify", "--runtime", "vllm"],
    ["verify", "--db", "sqlite:///x.db", "--journal", "x.jsonl"],
    ["replay", "--db", "sqlite:///x.db", "--journal", "x.jsonl"],
    ["replay", "--at", "-1"],
    ["replay", "--at", "x"],
    ["replay", "--block-bytes", "0"],
    ["replay", "--window-ms", "nan"],
    ["replay", "--slo-ttft-ms", "-5"],
    ["replay", "--checkpoint", ""],
    ["export", "--db", "sqlite:///x.db"],
])
def test_read_side_options_refuse_bad_values_in_one_coded_line(tmp_path, capsys, monkeypatch, argv):
    """Every option of verify, replay and export is refused as the checked arguments are
    (kvledger.args): INVALID_ARGUMENT in one line, exit 2, nothing opened; never
    argparse's usage text, which carries no code."""
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli(capsys, *argv)
    assert rc == 2 and out == ""
    one_coded_line(err, "INVALID_ARGUMENT")
    assert not list(tmp_path.iterdir())  # no database was created


# -- each rule of verify, broken once in a sound trajectory ---------------------------------

# line (1-based) of two_request_trajectory.jsonl (or of runtime_trace.jsonl, its line given as "R9"), the
# bytes it holds, what they become -> the finding and what it says
BROKEN = {
    "b_token": (1, b'"b_token":64', b'"b_token":65', "B_TOKEN_MISMATCH", "b_token 65"),
    "request": (1, b'"request_id":"A","handle_generation"', b'"request_id":"X","handle_generation"',
                "REQUEST_MISMATCH", "request X, manifest names A"),
    "capacity": (1, b'"reserved_capacity":8', b'"reserved_capacity":4', "CAPACITY_EXCEEDED",
                 "[4, 5) exceeds reserved capacity 4"),
    "txn twice": (8, b'"txn_id":"A-decode-1","kind"', b'"txn_id":"A-prefill","kind"', "DUPLICATE_TXN",
                  "transaction A-prefill started twice"),
    "cache positions": (8, b'"cache_positions":[4]', b'"cache_positions":[5]', "POSITION_MASK_MISMATCH",
                        "do not cover [4, 5)"),
    "mask extent": (8, b'"mask_key_extent":5', b'"mask_key_extent":4', "POSITION_MASK_MISMATCH",
                    "mask key extent 4 < 5"),
    "verify drafts": (8, b'"kind":"decode"', b'"kind":"verify"', "FRONTIER_MISMATCH", "verify drafts start at 4"),
    "publish snapshot": (9, b'"result_snapshot_version":2', b'"result_snapshot_version":3', "SNAPSHOT_DISCONTINUITY",
                         "1 -> 3"),
    "accepted": (9, b'"accepted_count":1', b'"accepted_count":2', "REJECTED_SUFFIX", "accepts 2 of 1 staged rows"),
    "committed": (9, b'"committed_length":5', b'"committed_length":6', "COMMITTED_LENGTH_MISMATCH",
                  "committed length 6 != "),
    "accepted fewer": (9, b'"accepted_count":1', b'"accepted_count":0', "COMMITTED_LENGTH_MISMATCH",
                       "decode commits 0 of 1 staged rows"),
    "output base": (7, b'"snapshot_version":1}', b'"snapshot_version":0}', "STALE_BASE", "output from snapshot 0"),
    "generation": (15, b'"result_generation":1', b'"result_generation":0', "GENERATION_REGRESSION",
                   "release moves generation 0 -> 0"),
    "released": (15, b'"released_length":5', b'"released_length":4', "RELEASE_LENGTH_MISMATCH", "releases 4 of 5"),
    "release snapshot": (15, b'"result_snapshot_version":3', b'"result_snapshot_version":5',
                         "SNAPSHOT_DISCONTINUITY", "snapshot 2 -> 5"),
}
BROKEN.update({
    "fork digest": ("R9", b'"manifest_sha256":"acc5', b'"manifest_sha256":"bcc5', "DIGEST_MISMATCH",
                    "fork manifest_sha256 differs from the parent's"),
    "fork b_token": ("R9", b'"b_token":64', b'"b_token":65', "B_TOKEN_MISMATCH", "fork b_token or layer count"),
    "publish after failure": ("R8", b'"txn_id":"decode-2"', b'"txn_id":"decode-1"', "TXN_ABORTED",
                              "publish of decode-1 after its failure"),
    "failure of no start": ("R6", b'"txn_id":"decode-1"', b'"txn_id":"nope"', "FAILURE_WITHOUT_START",
                            "failure of nope, which is not open"),
    "failure's base": ("R6", b'"base_snapshot_version":1', b'"base_snapshot_version":0', "FAILURE_CHANGES_STATE",
                       "failure claims base 0"),
    "truncate grows": ("R10", b'"new_length":3', b'"new_length":9', "TRUNCATE_GROWS", "truncate to 9 > committed 5"),
    "truncate outputs": ("R10", b'"output_count":0', b'"output_count":1', "COUNT_MISMATCH",
                         "truncate keeps 1 outputs"),
})
SOURCES = {"": FIXTURES / "two_request_trajectory.jsonl", "R": FIXTURES / "runtime_trace.jsonl"}


@pytest.mark.parametrize("case", list(BROKEN))
def test_each_rule_finds_the_one_event_that_breaks_it(case, capsys, tmp_path):
    at, old, new, code, says = BROKEN[case]
    source, n = (SOURCES["R"], int(at[1:])) if isinstance(at, str) else (SOURCES[""], at)
    lines = source.read_bytes().splitlines()
    assert old in lines[n - 1]
    lines[n - 1] = lines[n - 1].replace(old, new, 1)
    path = tmp_path / "broken.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    status, out, _ = cli(capsys, "verify", "--journal", str(path), "--json")
    found = [f for f in json.loads(out)["findings"] if f["code"] == code]
    assert status == 1 and any(says in f["message"] for f in found), (found, json.loads(out)["findings"][:4])
