"""`kvledger crash-test`: 32 kill-and-recover trials per backend (every fault point with
every action, and 8 SIGKILLs; 12 more with the command service in a writer process), every
named fault point hit, zero lost acknowledged writes, zero partial operations, zero digest or
output mismatches. Run as the CLI: it forks its trials from a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import pipelined_postgres

from kvledger.journal import faults

from budget import scaled

TRIALS = 24  # 24 fault plans cover the 18 (point, action) pairs; CI's time budget sets no more


def _kvledger(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_FAULTS")}, **(env or {})}
    return subprocess.run([sys.executable, "-m", "kvledger", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.nats_case("NATS's crash trials are tests/test_crash_nats.py: fewer, for CI's time")
@pytest.mark.sqlite_case("a writer process's trials on SQLite; PostgreSQL's writers die in its thread trials",
                         writer="process")
@pytest.mark.parametrize("writer, trials", [("thread", TRIALS), ("process", 12)])
def test_crash_test_trials(db_url, tmp_path, writer, trials):
    """`process`: the worker's command service in a writer process, both killed together
    (their process group) or the writer alone dying at a fault point."""
    url = db_url if db_url.startswith("postgresql") else f"sqlite:///{tmp_path}/crash.db"
    p = _kvledger("crash-test", "--db", url, "--trials", str(trials), "--seed", "3", "--json", "--writer", writer)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    r = json.loads(p.stdout)
    summary = {k: r[k] for k in ("trials", "lost", "partial", "digest_mismatches", "output_mismatches",
                                 "verify_findings", "unfinished", "second_recover_writes",
                                 "checkpoint_mismatches", "recovery_errors", "child_failures",
                                 "fault_points_hit", "crash_moments", "acknowledged_writes_checked",
                                 "seconds", "mean_trial_ms")}
    print(f"\ncrash-test {r['backend']} ({writer} writer): {json.dumps(summary)}")
    assert r["writer"] == writer
    _no_violation(r, trials)
    assert r["fault_points_missed"] == [] and set(r["fault_points_hit"]) == set(faults.POINTS)
    assert all(n >= 1 for n in r["fault_points_hit"].values())
    assert r["crash_moments"]["crashed"] >= trials - 5 and r["crash_moments"]["by_mode"]["sigkill"] >= trials // 5
    assert r["acknowledged_writes_checked"] > 20 * trials
    assert r["rows_reexecuted"] > 0 and r["aborted_appends"] > 0 and r["unacknowledged_commits"] > 0
    # the trial journals and logs of a passing run are gone; only the named database is left
    assert not any(tmp_path.glob("kvledger-crash-*"))


def _no_violation(r: dict, trials: int) -> None:
    assert r["ok"] and r["violations"] == [] and r["trials"] == trials
    assert (r["lost"], r["partial"], r["digest_mismatches"], r["output_mismatches"]) == (0, 0, 0, 0)
    assert (r["verify_findings"], r["unfinished"], r["second_recover_writes"], r["checkpoint_mismatches"],
            r["recovery_errors"], r["child_failures"]) == (0, 0, 0, 0, 0, 0)


def test_crash_test_trials_with_postgres_statements_pipelined(pg_admin, monkeypatch):
    """PostgreSQL as a remote server is written to: its statements pipelined
    (KVLEDGER_PG_PIPELINE=on; the test server is on loopback, where they go one by one).
    A verdict read before its statement's result arrived once broke the streams' chains
    at the first commit of decode steps beside an arrival."""
    trials = scaled(8, 12)  # 8: two SIGKILLs and an exit at each fault point
    pipelined_postgres(monkeypatch, True)
    p = _kvledger("crash-test", "--db", pg_admin.create(), "--trials", str(trials), "--seed", "5", "--json")
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    r = json.loads(p.stdout)
    _no_violation(r, trials)
    assert r["acknowledged_writes_checked"] > 10 * trials and r["crash_moments"]["crashed"] >= trials - 5


def test_crash_test_over_a_unix_socket(pg_admin):
    """A URL that names the server by its socket's directory (libpq's `?host=/dir`) is the
    server the trials' scratch databases are made on too, not the default socket."""
    server = pg_admin.server
    if server is None:
        pytest.skip("KVLEDGER_TEST_POSTGRES_URL names the server: no socket of the tests' own")
    url = f"postgresql+psycopg://postgres@/postgres?host={server.dir / 'sock'}&port={server.port}"
    p = _kvledger("crash-test", "--db", url, "--trials", "2", "--seed", "7", "--json")
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    r = json.loads(p.stdout)
    _no_violation(r, 2)
    assert r["backend"] == "postgresql" and r["acknowledged_writes_checked"] > 0


def test_crash_test_text_report_and_bad_input(tmp_path):
    p = _kvledger("crash-test", "--db", f"sqlite:///{tmp_path}/c.db", "--trials", "3", "--seed", "1")
    assert p.returncode == 0, p.stderr[-2000:]
    for line in ("trials", "crash moments", "fault points hit", "acknowledged writes checked",
                 "lost acknowledged writes", "partial operations", "digest mismatches"):
        assert line in p.stdout
    assert "ok: no violation" in p.stdout
    p = _kvledger("crash-test", "--trials", "0")
    assert p.returncode == 2 and p.stderr.startswith("INVALID_ARGUMENT")
    p = _kvledger("crash-test", "--db", "mysql://x/y", "--trials", "1")
    assert p.returncode == 2 and p.stderr.startswith("BAD_DATABASE_URL")
    # servers that do not answer: refused, and no empty work directory left behind
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    p = _kvledger("crash-test", "--db", "postgresql://kvl@127.0.0.1:1/kvl", "--trials", "1",
                  env={"TMPDIR": str(scratch)})
    assert p.returncode == 2 and p.stderr.startswith("DATABASE_UNREACHABLE"), p.stderr[-2000:]
    assert not any(scratch.iterdir())


@pytest.mark.slow
def test_crash_test_soak(tmp_path):
    p = _kvledger("crash-test", "--db", f"sqlite:///{tmp_path}/soak.db", "--trials", "1000", "--json",
                  timeout=7200)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout)["ok"]
