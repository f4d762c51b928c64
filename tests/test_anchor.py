"""Issue 44, an anchored journal: `kvledger head` prints POSITION:CHAIN_DIGEST (signed with
an operator's key on request), and `verify --expect` finds what the chain alone cannot: a
rollback to an older copy, a deleted tail, an emptied journal, a -wal deleted after a
crash, a different history. Each is shown clean without the anchor first (that is the
point), then a finding with it; real databases, real damage, a real SIGKILL."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url
from test_replay_workload import write_workload

from kvledger import Ledger
from kvledger.journal.record_format import GENESIS
from kvledger.journal.tables import JOURNAL_TABLES

from lifecycle_helpers import ManualClock
from stored_rows import cli, close_sessions, copy_head, one_coded_line, records, sql

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def grow(url: str, seed: int) -> None:
    """One more mixed workload of real commands: dozens of commits, every invariant held."""
    clock = ManualClock()
    with Ledger.open(url, clock=clock) as led:
        write_workload(led, clock, seed=seed)


def head(capsys, url: str, *extra: str) -> dict:
    code, out, err = cli(capsys, "head", "--db", url, "--json", *extra)
    assert code == 0 and err == "", err
    return json.loads(out)


def verify(capsys, url: str, *extra: str) -> tuple[int, dict]:
    code, out, err = cli(capsys, "verify", "--db", url, "--json", *extra)
    assert code in (0, 1) and err == "", (code, err)
    return code, json.loads(out)


def anchor_findings(report: dict) -> list[str]:
    return [f["message"] for f in report["findings"] if f["code"] == "ANCHOR_MISMATCH"]


def key_file(tmp_path: Path, name: str, content: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


def mac(key: bytes, position: int, chain: str) -> str:
    """The signature as the docs define it, computed here on its own."""
    text = f"kvledger-anchor/1\nposition {position}\nchain {chain}\n".encode()
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def sqlite_file(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///"))


# -- head ----------------------------------------------------------------------------------

def test_head_names_the_last_position_and_its_chain_digest(db_url, capsys, tmp_path):
    empty = head(capsys, db_url)
    assert (empty["position"], empty["chain"], empty["signature"]) == (0, GENESIS.hex(), None)
    assert empty["anchor"] == f"0:{GENESIS.hex()}"
    grow(db_url, 1)
    got = head(capsys, db_url)
    last, chain = records(db_url)[-1][::3]
    assert (got["position"], got["chain"]) == (last, chain.hex()) and last > 50
    code, out, err = cli(capsys, "head", "--db", db_url)
    assert code == 0 and out == f"{last}:{chain.hex()}\n" and err == ""
    # signed: the same key as hex or as raw bytes signs alike; the key is never printed
    key = os.urandom(32)
    for path in (key_file(tmp_path, "k.hex", key.hex().encode() + b"\n"), key_file(tmp_path, "k.bin", key)):
        code, out, err = cli(capsys, "head", "--db", db_url, "--key", path)
        assert code == 0 and out == f"{last}:{bytes(chain).hex()}:{mac(key, last, bytes(chain).hex())}\n"
        assert key.hex() not in out + err
    signed = head(capsys, db_url, "--key", path)
    assert signed["signature"] == mac(key, last, bytes(chain).hex()) and signed["anchor"].endswith(signed["signature"])


def test_head_refuses_a_key_file_it_cannot_use(db_url, capsys, tmp_path):
    secret = b"0123456789abcdef"[:15]
    for path, why in ((key_file(tmp_path, "short", secret), "at least 16"),
                      (str(tmp_path / "absent"), "cannot read"),
                      (key_file(tmp_path, "huge", os.urandom(1 << 17)), "not a key file")):
        code, out, err = cli(capsys, "head", "--db", db_url, "--key", path)
        assert code == 2 and out == "" and why in one_coded_line(err, "INVALID_ARGUMENT")
        assert secret.decode() not in err


# -- verify --expect -------------------------------------------------------------------

def test_a_journal_grown_past_its_anchor_verifies_clean(db_url, capsys, tmp_path):
    anchors = [head(capsys, db_url)["anchor"]]  # the empty journal's too
    grow(db_url, 1)
    anchors.append(head(capsys, db_url)["anchor"])
    key = key_file(tmp_path, "k", os.urandom(32))
    signed = head(capsys, db_url, "--key", key)["anchor"]
    grow(db_url, 2)
    for anchor, extra in [(a, ()) for a in anchors] + [(signed, ("--key", key))]:
        code, report = verify(capsys, db_url, "--expect", anchor, *extra)
        assert code == 0 and report["ok"] and "the journal extends it" in report["anchor"], report
    assert "signature verified" in report["anchor"]
    code, out, _ = cli(capsys, "verify", "--db", db_url, "--expect", anchors[1])
    assert code == 0 and f"anchor {anchors[1]}: the journal extends it" in out


def _copy_database(request, url: str, tmp_path: Path) -> str:
    """A copy of the journal as it is now (SQLite: the file after a checkpoint; PostgreSQL:
    CREATE DATABASE ... TEMPLATE), the way an operator's backup is."""
    if url.startswith("sqlite"):
        sql(url, "PRAGMA wal_checkpoint(TRUNCATE)")
        copy = tmp_path / "backup.db"
        shutil.copyfile(sqlite_file(url), copy)
        return f"sqlite:///{copy}"
    close_sessions()
    admin = request.getfixturevalue("pg_admin").scratch
    name = f"{make_url(url).database}_backup"
    with admin.connect() as conn:  # names built here, not input
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{make_url(url).database}"')
    return admin.url(name)


def _restore(request, url: str, backup: str) -> None:
    """The database replaced by the older copy (SQLite: the file, with no -wal beside it;
    PostgreSQL: the database dropped and created again from the copy)."""
    if url.startswith("sqlite"):
        path = sqlite_file(url)
        for companion in ("-wal", "-shm"):
            Path(f"{path}{companion}").unlink(missing_ok=True)
        shutil.copyfile(sqlite_file(backup), path)
        return
    admin = request.getfixturevalue("pg_admin").scratch
    name, copy = make_url(url).database, make_url(backup).database
    with admin.connect() as conn:  # names built here, not input
        conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{copy}"')


@pytest.mark.sql_storage("copies and restores a SQL database as an operator's backup is")
def test_a_rollback_to_an_older_copy_is_found_only_against_an_anchor(db_url, capsys, tmp_path, request):
    grow(db_url, 1)
    backup = _copy_database(request, db_url, tmp_path)
    grow(db_url, 2)
    anchor = head(capsys, db_url)
    _restore(request, db_url, backup)
    code, report = verify(capsys, db_url)
    assert code == 0 and report["ok"]  # the chain alone: a whole, shorter journal
    code, report = verify(capsys, db_url, "--expect", anchor["anchor"])
    [finding] = anchor_findings(report)
    assert code == 1 and finding.startswith("rolled back: the journal ends at position ")
    assert f"before the anchor's {anchor['position']}" in finding and report["findings"][0]["code"] == "ANCHOR_MISMATCH"


@pytest.mark.sql_storage("deletes SQL rows: a NATS stream denies delete and purge")
def test_deleted_last_records_are_a_deleted_tail(db_url, capsys):
    grow(db_url, 1)
    anchor = head(capsys, db_url)["anchor"]
    [(cut,)] = sql(db_url, "SELECT last_position FROM kvl_records ORDER BY last_position DESC LIMIT 1 OFFSET 3")
    sql(db_url, "DELETE FROM kvl_records WHERE last_position > :p", p=cut)
    code, report = verify(capsys, db_url, "--expect", anchor)
    [finding] = anchor_findings(report)
    assert code == 1 and finding.startswith(f"deleted tail: the journal ends at position {cut}, before the anchor's")


@pytest.mark.sql_storage("deletes SQL rows: a NATS stream denies delete and purge")
def test_an_emptied_journal_is_found_only_against_an_anchor(db_url, capsys):
    grow(db_url, 1)
    anchor = head(capsys, db_url)["anchor"]
    for table in JOURNAL_TABLES:  # constant names
        sql(db_url, f"DELETE FROM {table}")
    code, report = verify(capsys, db_url)
    assert code == 0 and report["ok"] and report["events"] == 0
    code, report = verify(capsys, db_url, "--expect", anchor)
    [finding] = anchor_findings(report)
    assert code == 1 and finding.startswith("emptied: the journal holds no events")
    assert head(capsys, db_url)["anchor"] == f"0:{GENESIS.hex()}"


@pytest.mark.sql_storage("copies and restores a SQL database as an operator's backup is")
def test_a_different_history_at_the_anchor_is_found(db_url, capsys, tmp_path, request):
    """The journal emptied and written again with the same workload (the same number of
    events, other ids), and a position where no commit ends, against the first's anchor."""
    grow(db_url, 1)
    anchor = head(capsys, db_url)
    other = _copy_database(request, db_url, tmp_path)
    for table in JOURNAL_TABLES:  # constant names
        sql(other, f"DELETE FROM {table}")
    grow(other, 1)
    rewritten = head(capsys, other)
    assert rewritten["position"] == anchor["position"] and rewritten["chain"] != anchor["chain"]
    code, report = verify(capsys, other, "--expect", anchor["anchor"])
    [finding] = anchor_findings(report)
    assert code == 1 and finding.startswith(f"different history: the chain digest at position {anchor['position']} is")
    [(first, last)] = sql(db_url, "SELECT first_position, last_position FROM kvl_records "
                                  "WHERE last_position > first_position LIMIT 1")
    code, report = verify(capsys, db_url, "--expect", f"{first}:{anchor['chain']}")
    assert code == 1 and anchor_findings(report) == [
        f"different history: no commit of this journal ends at position {first}, the anchor's"]


def test_a_forged_or_unsigned_anchor_fails_against_the_key(db_url, capsys, tmp_path):
    grow(db_url, 1)
    key, other = key_file(tmp_path, "k", os.urandom(32)), key_file(tmp_path, "o", os.urandom(32))
    signed = head(capsys, db_url, "--key", key)
    p, chain, signature = signed["position"], signed["chain"], signed["signature"]
    forged = {
        "another key": (f"{p}:{chain}:{signature}", other),
        "another position": (f"{p - 1}:{chain}:{signature}", key),
        "another digest": (f"{p}:{'0' * 64}:{signature}", key),
        "a signature of its own": (f"{p}:{chain}:{mac(b'guessed-key-0123', p, chain)}", key),
    }
    for name, (anchor, path) in forged.items():
        code, report = verify(capsys, db_url, "--expect", anchor, "--key", path)
        assert code == 1 and anchor_findings(report) == [
            "bad signature: the anchor's signature does not verify with --key: it was not made with this key, "
            "or the anchor was altered"], name
    code, report = verify(capsys, db_url, "--expect", f"{p}:{chain}", "--key", key)
    assert code == 1 and anchor_findings(report)[0].startswith("unsigned: the anchor carries no signature")
    code, report = verify(capsys, db_url, "--expect", signed["anchor"], "--key", key)
    assert code == 0 and report["ok"]


@pytest.mark.parametrize("argv, why", [
    (["--expect", "12"], "is not an anchor"),
    (["--expect", "12:abc"], "is not an anchor"),
    ([f"--expect=-1:{'a' * 64}"], "is not an anchor"),
    (["--expect", f"99999999999999999999:{'a' * 64}"], "is not an anchor"),
    (["--expect", f"1:{'a' * 64}:{'b' * 63}"], "is not an anchor"),
    (["--expect", f"1:{'a' * 64}:{'b' * 64}"], "give --key FILE"),
    (["--key", "k"], "give both"),
    (["--expect", f"1:{'a' * 64}", "--journal", "x.jsonl"], "an audit file (--journal) has none"),
])
def test_verify_refuses_an_anchor_it_cannot_check_in_one_coded_line(tmp_path, capsys, monkeypatch, argv, why):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "k").write_bytes(os.urandom(32))
    code, out, err = cli(capsys, "verify", *argv)
    assert code == 2 and out == "" and why in one_coded_line(err, "INVALID_ARGUMENT"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k"]  # no database was opened or created


# -- a deleted -wal after a SIGKILLed writer (SQLite) ---------------------------------------

def writer_script(body: str) -> str:
    """A process that opens the journal and runs `body` (indented, with `led` and `clock`)."""
    return textwrap.dedent("""
        import sys
        sys.path.insert(0, {tests!r})
        from lifecycle_helpers import ManualClock
        from test_replay_workload import write_workload
        from kvledger import Ledger

        clock = ManualClock()
        with Ledger.open({url!r}, clock=clock) as led:
    """) + textwrap.indent(textwrap.dedent(body), "    ")


WRITER = writer_script("""
    write_workload(led, clock, seed=0)
    # what the main file holds from here on: later commits stay in the -wal
    led.journal.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    led.journal.conn.execute("PRAGMA wal_autocheckpoint=0")
    print("checkpointed", flush=True)
    seed = 0
    while True:
        seed += 1
        write_workload(led, clock, seed=seed)
        print(seed, flush=True)
""")


def start_writer(tmp_path: Path, script: str, first_line: str) -> tuple[str, subprocess.Popen]:
    """A new SQLite journal, and a writer process on it that has printed `first_line`."""
    from kvledger.migrations.storage import init_database

    url = f"sqlite:///{tmp_path / 'journal.db'}"
    init_database(url)
    writer = subprocess.Popen([sys.executable, "-c", script.format(tests=str(TESTS), url=url)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = writer.stdout.readline().strip()
    if line != first_line:
        writer.kill()
        pytest.fail(f"the writer printed {line!r}: {writer.stderr.read()}")
    return url, writer


def test_a_deleted_wal_after_a_sigkilled_writer_is_a_rollback(tmp_path, capsys):
    url, writer = start_writer(tmp_path, WRITER, "checkpointed")
    try:
        assert writer.stdout.readline().strip() == "1"  # a whole workload past the checkpoint
        anchor = head(capsys, url)
        writer.stdout.readline()  # and more commits after the anchor, mid-workload when killed
        time.sleep(0.05)
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == -signal.SIGKILL
    wal = Path(f"{sqlite_file(url)}-wal")
    assert wal.stat().st_size > 0
    wal.unlink()
    Path(f"{sqlite_file(url)}-shm").unlink()
    code, report = verify(capsys, url)
    assert code == 0 and report["ok"] and 0 < report["events"] < anchor["position"]  # clean without the anchor
    code, report = verify(capsys, url, "--expect", anchor["anchor"])
    [finding] = anchor_findings(report)
    assert code == 1 and finding.startswith(f"rolled back: the journal ends at position {report['events']}, "
                                            f"before the anchor's {anchor['position']}")


# -- replay refuses a journal whose head rows and records disagree ----------------------------

@pytest.mark.sql_storage("deletes SQL rows: a NATS stream denies delete and purge")
def test_replay_refuses_a_journal_whose_last_records_were_deleted(db_url, capsys):
    """The head rows still name what the deleted records held: replay (full and
    incremental) refuses in one coded line, where it used to print a shorter journal."""
    grow(db_url, 1)
    assert cli(capsys, "replay", "--db", db_url, "--incremental", "--json")[0] == 0
    grow(db_url, 2)
    [(cut,)] = sql(db_url, "SELECT last_position FROM kvl_records ORDER BY last_position DESC LIMIT 1 OFFSET 3")
    sql(db_url, "DELETE FROM kvl_records WHERE last_position > :p", p=cut)
    for extra in ((), ("--incremental",)):
        code, out, err = cli(capsys, "replay", "--db", db_url, "--json", *extra)
        assert code == 2 and out == "", (extra, out[:200])
        line = one_coded_line(err, "CORRUPT_JOURNAL")
        assert "the journal's head rows and records disagree: " in line and "run `kvledger verify`" in line
    code, out, err = cli(capsys, "replay", "--db", db_url, "--json", "--at", str(cut))
    assert code == 0 and json.loads(out)["position"] == cut  # time travel reads what is there


@pytest.mark.sql_storage("rewrites head rows: a NATS cell keeps its heads in its stream")
@pytest.mark.parametrize("tamper, says", [
    (lambda url, h: sql(url, "UPDATE kvl_heads SET stream_position = stream_position + 1 WHERE handle_id = :h", h=h),
     "its last event at"),
    (lambda url, h: copy_head(url, h, "ghost"), "and no event of it was read"),
], ids=["a head past its events", "a head of no events"])
def test_replay_refuses_a_head_row_its_events_do_not_reach(db_url, capsys, tamper, says):
    """A head row that no stream of events read leads to: its position past the stream's
    last event, or a stream with none at all (a record of its events deleted whole)."""
    grow(db_url, 1)
    tamper(db_url, min(sql(db_url, "SELECT handle_id FROM kvl_heads"))[0])
    code, out, err = cli(capsys, "replay", "--db", db_url, "--json")
    assert code == 2 and out == ""
    line = one_coded_line(err, "CORRUPT_JOURNAL")
    assert "the journal's head rows and records disagree: " in line and says in line, line


@pytest.mark.sql_storage("deletes SQL rows: a NATS stream denies delete and purge")
def test_replay_refuses_a_kv_event_stream_whose_records_were_deleted(db_url, capsys, tmp_path):
    """A KV-event stream's head row (the recorder's) whose record is gone."""
    lines = [json.dumps({"seq": seq, "ts": float(seq), "events": [
        {"type": "BlockStored", "block_hashes": [seq + 1], "parent_block_hash": None, "token_ids": [seq],
         "block_size": 1}]}) for seq in range(3)]
    path = tmp_path / "kv.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, _, err = cli(capsys, "kv-events", "import", str(path), "--dialect", "vllm", "--db", db_url)
    assert code == 0, err
    assert cli(capsys, "replay", "--db", db_url, "--json")[0] == 0
    sql(db_url, "DELETE FROM kvl_records")
    code, out, err = cli(capsys, "replay", "--db", db_url, "--json")
    assert code == 2 and "past the journal's end at 0" in one_coded_line(err, "CORRUPT_JOURNAL")


COMMITTING = writer_script("""
    print("ready", flush=True)
    seed = 0
    while True:
        seed += 1
        write_workload(led, clock, seed=seed)
""")


def test_replay_beside_a_running_writer_never_sees_a_disagreement(tmp_path):
    """The head rows are read before the events: a writer committing meanwhile moves
    only the events past them, never a head past its events."""
    from kvledger.migrations.storage import open_existing_journal
    from kvledger.replay import WindowSpec, replay_journal

    url, writer = start_writer(tmp_path, COMMITTING, "ready")
    try:
        positions = []
        with open_existing_journal(url) as journal:
            start = time.monotonic()
            while time.monotonic() < start + 4 or len(positions) < 10:
                positions.append(replay_journal(journal, WindowSpec(1, 1)).position)
        assert writer.poll() is None, writer.stderr.read()
    finally:
        writer.kill()
        writer.wait()
    assert positions == sorted(positions) and len(set(positions)) >= 5, positions
