"""A PostgreSQL session lost in the middle of a command (pg_terminate_backend on a real
server): a read is read again on a new session; a commit, its outcome unknown, is sent
again by the command service with the same operation ids (it lands once); verify, whose
snapshot is lost with it, ends with exactly one coded line, never a traceback.

The command is held at a known point: the test takes an ACCESS EXCLUSIVE lock on the
journal's tables, waits until the command's session waits for it, ends that session, then
lets the lock go. The pool used to log the failed rollback of the dead connection with its
traceback (sqlalchemy.pool, "Exception during reset or similar"): ~30 lines before the code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from kvledger.journal.pgserver import conninfo
from kvledger.migrations.storage import open_or_create_journal
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.receipts import Receipt

from demo_runs import demo_env
from factories import allocate_op, guard_of, publish_op

pytestmark = pytest.mark.postgres

LAST_POSITION = ("SELECT coalesce((SELECT max(last_position) FROM kvl_records), "
                 "(SELECT max(global_position) FROM kvl_events), 0)")


def _start(url: str, *argv: str, cwd: Path) -> subprocess.Popen[str]:
    env = demo_env({k: v for k, v in os.environ.items() if k not in ("KVLEDGER_LOG", "KVLEDGER_DEBUG")})
    return subprocess.Popen([sys.executable, "-m", "kvledger", *argv, "--db", url], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)


def _wait(cond, what: str, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"the command ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


def _cut_while_waiting(url: str, admin: psycopg.Connection, proc: subprocess.Popen[str]) -> int:
    """With the lock held by `admin`: once the command's session waits for it, end every
    session of the command; returns the journal's last position under the lock."""
    position = admin.execute(LAST_POSITION).fetchone()[0]
    # pg_stat_activity is a snapshot per transaction: watched from a session of its own
    with psycopg.connect(conninfo(url), autocommit=True) as watch:
        mine = (admin.info.backend_pid, watch.info.backend_pid)
        others = f"pid NOT IN {mine} AND datname = current_database()"
        _wait(lambda: watch.execute(f"SELECT count(*) FROM pg_stat_activity WHERE {others} "
                                    "AND wait_event_type = 'Lock'").fetchone()[0] > 0, "lock wait", proc)
        ended = watch.execute(f"SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                              f"WHERE {others}").fetchone()[0]
    assert ended >= 1
    admin.rollback()  # the lock goes
    return position


def _check_one_coded_line(proc: subprocess.Popen[str], url: str) -> None:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    host = psycopg.conninfo.conninfo_to_dict(conninfo(url))["host"]  # KVLEDGER_TEST_POSTGRES_URL's, if set
    assert err.startswith(f"DATABASE_UNREACHABLE: PostgreSQL at {host}:"), err
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_session_lost_during_demo_is_asked_again_and_the_run_completes(pg_admin, tmp_path, writer):
    """The commit the lost session left unknown is sent again (its operation ids land it
    once) once the journal has connected again: the demo finishes and journals what the
    same demo journals undisturbed, and the journal verifies."""
    from demo_runs import DEMO, assert_journaled_as_undisturbed

    url = pg_admin.create()
    proc = _start(url, *DEMO, "--writer", writer, cwd=tmp_path)
    try:
        with psycopg.connect(conninfo(url)) as admin:
            admin.autocommit = True
            _wait(lambda: admin.execute(LAST_POSITION).fetchone()[0] > 200, "200 events committed", proc)
            admin.autocommit = False
            # every writer locks kvl_events first: holding it alone, the test cannot deadlock
            # with one (locking kvl_heads then kvl_records did, against a writer between them)
            admin.execute("LOCK TABLE kvl_events IN ACCESS EXCLUSIVE MODE")
            position = _cut_while_waiting(url, admin, proc)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "the journal did not take a commit (DATABASE_UNREACHABLE" in err  # it met the cut
    got = json.loads(out)
    assert got["position"] > position > 200
    assert_journaled_as_undisturbed(got)
    check = subprocess.run([sys.executable, "-m", "kvledger", "verify", "--db", url], capture_output=True, text=True,
                           timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("command", [["replay", "--json"], ["export", "--out", "audit.jsonl"]])
def test_a_session_lost_during_a_read_is_read_again(pg_admin, tmp_path, command):
    """A read has no outcome to lose: the journal reads it again on a new session."""
    url = pg_admin.create()
    with psycopg.connect(conninfo(url)) as admin:
        admin.execute("LOCK TABLE kvl_records IN ACCESS EXCLUSIVE MODE")  # before the command reads it
        proc = _start(url, *command, cwd=tmp_path)
        try:
            _cut_while_waiting(url, admin, proc)
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert (tmp_path / "audit.jsonl").exists() if "export" in command else json.loads(out)["position"] == 0


def test_a_session_lost_during_verify_is_one_coded_line(pg_admin, tmp_path):
    """verify reads one snapshot of the whole journal: a lost session loses it (one coded line)."""
    url = pg_admin.create()
    with psycopg.connect(conninfo(url)) as admin:
        admin.execute("LOCK TABLE kvl_records IN ACCESS EXCLUSIVE MODE")  # before the command reads it
        proc = _start(url, "verify", cwd=tmp_path)
        try:
            _cut_while_waiting(url, admin, proc)
            _check_one_coded_line(proc, url)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.mark.parametrize("end", ["terminated", "idle_timeout"])
def test_a_journal_connects_again_after_its_session_ended(pg_admin, end):
    """The server ends an idle journal's session (an operator's pg_terminate_backend, an
    idle_session_timeout, a restart): the call that finds it out raises its coded error,
    as a lost connection's outcome is unknown, and the next call connects again, where
    the same operation lands once."""
    url = pg_admin.create()
    with psycopg.connect(conninfo(url), autocommit=True) as admin:
        if end == "idle_timeout":  # the scratch database's own name: no input reaches the statement
            admin.execute(f"ALTER DATABASE \"{admin.info.dbname}\" SET idle_session_timeout = '300ms'")
        with open_or_create_journal(url) as j:
            j.append([allocate_op("h")])
            base = guard_of(j.head("h"))
            if end == "terminated":
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                              "WHERE datname = current_database() AND pid <> pg_backend_pid()")
            time.sleep(0.6)
            with pytest.raises(KvLedgerError) as lost:
                j.append([publish_op("h", base, "p1")])
            assert lost.value.code in (ErrorCode.DATABASE_UNREACHABLE, ErrorCode.DATABASE_ERROR)
            [landed] = j.append([publish_op("h", base, "p1")])
            assert isinstance(landed, Receipt)
            assert j.append([publish_op("h", base, "p1")]) == [landed]  # a retry: its stored receipt
            assert [e.stream_position for e in j.read_stream("h")] == [1, 2]


@pytest.mark.parametrize("call", ["append", "read"])
def test_a_connection_a_failed_call_left_mid_command_is_replaced(pg_admin, call):
    """A call interrupted mid-command (its results never read) leaves the session unable
    to serve another ("another command is already in progress") though the server never
    ended it: the failed call raises its coded error, and the next call connects again; a
    read, which has no outcome to lose, is read again at once."""
    url = pg_admin.create()
    with open_or_create_journal(url) as j:
        j.append([allocate_op("h")])
        base = guard_of(j.head("h"))
        j.conn.pgconn.send_query(b"SELECT 1")  # sent, its result never read: as an interrupted call leaves it
        if call == "read":
            assert [e.stream_position for e in j.read_stream("h")] == [1]
            return
        with pytest.raises(KvLedgerError) as failed:
            j.append([publish_op("h", base, "p1")])
        assert failed.value.code in (ErrorCode.DATABASE_UNREACHABLE, ErrorCode.DATABASE_ERROR), failed.value
        [landed] = j.append([publish_op("h", base, "p1")])
        assert isinstance(landed, Receipt)
        assert [e.stream_position for e in j.read_stream("h")] == [1, 2]
