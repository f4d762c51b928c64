"""`kvledger replay | export | import` on journals written by real commands: the
database and its exported file replay to identical JSON, --at N equals the first N
lines, an incremental projection resumed anywhere equals the full replay."""

from __future__ import annotations

import json
import random
import sqlite3
import sys
from pathlib import Path

import msgspec
import pytest
from test_replay_workload import WINDOW, write_workload

from kvledger import Ledger
from kvledger.cli import main
from kvledger.journal import open_journal as open_existing
from kvledger.migrations.storage import open_or_create_journal
from kvledger.replay import Projector, build, journal_events, project, replay_incremental, replay_journal, to_json

from lifecycle_helpers import ManualClock

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
KEYS = {"position", "handles", "ledger", "peaks", "byte_time", "requests", "window"}
FORK_KEYS = {"forks", "fork_window"}  # only where the journal holds forks


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def written(db_url, tmp_path):
    """A journal written by real commands, still running at the end (requests live)."""
    clock = ManualClock()
    with Ledger.open(db_url, clock=clock) as led:
        write_workload(led, clock, seed=3, rounds=2, finish=False)
    out = tmp_path / "journal.jsonl"
    return db_url, out


def test_db_and_exported_file_replay_identically(written, capsys):
    db_url, out = written
    code, _, err = cli(capsys, "export", "--db", db_url, "--out", str(out))
    assert code == 0 and "exported" in err
    lines = out.read_bytes().splitlines()
    with open_existing(db_url) as journal:
        assert lines == [body for _, body in journal.read_raw()]  # verbatim, in global order
        owning = replay_journal(journal, WINDOW).ledger.owners
    assert owning > 0  # the journal stops with requests still holding cache state
    code, from_db, _ = cli(capsys, "replay", "--db", db_url, "--json")
    assert code == 0
    code, from_file, _ = cli(capsys, "replay", "--journal", str(out), "--json")
    assert code == 0 and from_db == from_file
    report = json.loads(from_db)
    assert set(report) == KEYS | FORK_KEYS and report["position"] == len(lines)  # its requests fork


def test_at_n_equals_the_first_n_lines(written, capsys, tmp_path):
    db_url, out = written
    cli(capsys, "export", "--db", db_url, "--out", str(out))
    lines = out.read_bytes().splitlines(keepends=True)
    rnd = random.Random(1)
    for n in sorted({0, 1, len(lines), *rnd.sample(range(2, len(lines)), 4)}):
        prefix = tmp_path / f"first{n}.jsonl"
        prefix.write_bytes(b"".join(lines[:n]))
        args = ("--window-start-ms", "0", "--window-ms", "500")
        _, at_db, _ = cli(capsys, "replay", "--db", db_url, "--at", str(n), "--json", *args)
        _, at_file, _ = cli(capsys, "replay", "--journal", str(out), "--at", str(n), "--json", *args)
        _, whole_prefix, _ = cli(capsys, "replay", "--journal", str(prefix), "--json", *args)
        assert at_db == at_file == whole_prefix, n
        assert json.loads(at_db)["position"] == n
    code, _, err = cli(capsys, "replay", "--db", db_url, "--at", str(len(lines) + 1))
    assert code == 2 and err.startswith("INVALID_ARGUMENT") and "past the end" in err


def test_incremental_resumed_at_random_checkpoints_equals_full(db_url):
    clock = ManualClock()
    with Ledger.open(db_url, clock=clock) as led:
        write_workload(led, clock, seed=5, rounds=2)
        journal = led.journal
        events = list(journal_events(journal))
        full = to_json(build(project(events), WINDOW))
        rnd = random.Random(11)
        for k in sorted({0, len(events), *rnd.sample(range(1, len(events)), 6)}):
            # in memory: dump after k events, load, fold the rest
            resumed = Projector.load(project(events[:k]).dump())
            assert resumed is not None and resumed.position == k
            assert to_json(build(project(events[k:], projector=resumed), WINDOW)) == full, k
            # through the journal: a checkpoint stored at k, then --incremental
            journal.save_checkpoint("replay", k, project(events[:k]).dump())
            report, start = replay_incremental(journal, WINDOW)
            assert start == k and to_json(report) == full, k
            assert journal.load_checkpoint("replay")[0] == len(events)


def test_incremental_cli_follows_a_growing_journal(db_url, capsys):
    clock = ManualClock()
    with Ledger.open(db_url, clock=clock) as led:
        write_workload(led, clock, seed=2, finish=False)
    code, first, _ = cli(capsys, "replay", "--db", db_url, "--incremental", "--json")
    assert code == 0
    with Ledger.open(db_url, clock=clock) as led:  # more commands after the checkpoint
        clock.at(10_000)
        write_workload(led, clock, seed=4)
    _, full, _ = cli(capsys, "replay", "--db", db_url, "--json")
    _, resumed, _ = cli(capsys, "replay", "--db", db_url, "--incremental", "--json")
    assert resumed == full != first
    with open_existing(db_url) as journal:
        assert journal.load_checkpoint("replay")[0] == journal.last_position()
    code, text, _ = cli(capsys, "replay", "--db", db_url, "--incremental")
    assert code == 0 and "resumed from checkpoint 'replay'" in text


def test_a_checkpoint_of_another_journal_is_not_trusted(db_url, tmp_path):
    clock = ManualClock()
    with Ledger.open(db_url, clock=clock) as led:
        write_workload(led, clock, seed=1)
        journal = led.journal
        events = list(journal_events(journal))
        # a checkpoint whose last event is not this journal's event at that position
        with open_existing(f"sqlite:///{_other(tmp_path)}") as other_journal:
            other = project(list(journal_events(other_journal))[:10])
        journal.save_checkpoint("replay", other.position, other.dump())
        report, start = replay_incremental(journal, WINDOW)
        assert start == 0 and to_json(report) == to_json(build(project(events), WINDOW))
        journal.save_checkpoint("replay", 3, b"not a projection")
        report, start = replay_incremental(journal, WINDOW)
        assert start == 0 and to_json(report) == to_json(build(project(events), WINDOW))
        # a checkpoint written by code with another projection format
        older = msgspec.structs.replace(project(events[:5]).snapshot(), format="0:older")
        journal.save_checkpoint("replay", 5, msgspec.msgpack.encode(older))
        report, start = replay_incremental(journal, WINDOW)
        assert start == 0 and to_json(report) == to_json(build(project(events), WINDOW))


def _other(tmp_path: Path) -> Path:
    path = tmp_path / "other.db"
    clock = ManualClock()
    with Ledger.open(f"sqlite:///{path}", clock=clock) as led:
        write_workload(led, clock, seed=99)
    return path


def test_import_then_replay_and_export_round_trip(db_url, capsys, tmp_path):
    source = FIXTURES / "runtime_trace.jsonl"
    code, out, _ = cli(capsys, "import", "--db", db_url, str(source), "--json")
    assert code == 0 and json.loads(out)["events"] == 14
    again = tmp_path / "again.jsonl"
    cli(capsys, "export", "--db", db_url, "--out", str(again))
    assert again.read_bytes() == source.read_bytes()
    _, a, _ = cli(capsys, "replay", "--db", db_url, "--json")
    _, b, _ = cli(capsys, "replay", "--journal", str(source), "--json")
    assert a == b
    # the derived tables are what the command service writes
    with open_existing(db_url) as journal:
        heads = journal.heads()
        assert heads["R"].generation == 8 and heads["R"].lifecycle == "RELEASED"
        receipts = list(journal.read_receipts())
        assert len(receipts) == len({e.operation_id for e in journal_events(journal)})
        assert all(r.fingerprint == "imported" for r in receipts)
    # an import refuses a journal that already has events, and changes nothing
    code, _, err = cli(capsys, "import", "--db", db_url, str(source))
    assert code == 2 and err.startswith("INVALID_ARGUMENT") and "not empty" in err
    with open_existing(db_url) as journal:
        assert journal.last_position() == 14


@pytest.mark.parametrize("line, code", [
    (b"{not json", "MALFORMED_EVENT"),
    (b'{"event_type": "teleport", "schema_version": 1}', "UNKNOWN_EVENT_TYPE"),
    (b'{"event_type": "finish", "schema_version": 9}', "UNKNOWN_SCHEMA_VERSION"),
])
def test_bad_files_fail_in_one_line_and_import_changes_nothing(db_url, capsys, tmp_path, line, code):
    lines = (FIXTURES / "two_request_trajectory.jsonl").read_bytes().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(lines[:5]) + line + b"\n" + b"".join(lines[5:]))
    for args in (("import", "--db", db_url, str(bad)), ("replay", "--journal", str(bad))):
        rc, _, err = cli(capsys, *args)
        assert rc == 2 and err.startswith(f"{code}: ") and f"{bad}:6:" in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    with open_existing(db_url) as journal:
        assert journal.last_position() == 0 and journal.heads() == {}


def test_import_refuses_a_corrupt_file(db_url, capsys):
    corrupt = FIXTURES / "corrupt" / "publish_without_start.jsonl"
    rc, _, err = cli(capsys, "import", "--db", db_url, str(corrupt))
    assert rc == 2 and err.startswith("CORRUPT_JOURNAL") and "PUBLISH_WITHOUT_START" in err
    with open_existing(db_url) as journal:
        assert journal.last_position() == 0


def test_human_output_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="plotting is the optional `plot` extra")
    code, out, _ = cli(capsys, "replay", "--journal", str(FIXTURES / "phase_trace.jsonl"),
                       "--window-ms", "100", "--slo-ttft-ms", "15", "--slo-tbt-ms", "10",
                       "--plot", str(tmp_path / "bytes.png"))
    assert code == 0
    for text in ("Handles", "Byte ledgers", "resident[host]", "14,080.000 byte-ms", "Requests",
                 "throughput 20 req/s", "goodput 10 req/s", "fraction 0.500", "Saved work"):
        assert text in out, text
    png = (tmp_path / "bytes.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_plot_without_matplotlib_is_a_clear_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    code, _, err = cli(capsys, "replay", "--journal", str(FIXTURES / "phase_trace.jsonl"),
                       "--plot", str(tmp_path / "x.png"))
    assert code == 2 and "pip install 'kvledger[plot]'" in err and not (tmp_path / "x.png").exists()


def test_trajectory_json_and_reading_never_creates_a_database(capsys, tmp_path):
    code, out, _ = cli(capsys, "replay", "--journal", str(FIXTURES / "two_request_trajectory.jsonl"),
                       "--json", "--trajectory")
    report = msgspec.json.decode(out)
    assert code == 0 and set(report) == KEYS | {"trajectory"} and len(report["trajectory"]) == 21
    missing = tmp_path / "missing.db"
    for args in (("replay",), ("verify",), ("export", "--out", str(tmp_path / "x.jsonl"))):
        code, _, err = cli(capsys, *args, "--db", f"sqlite:///{missing}")
        assert code == 2 and err.startswith("DATABASE_NOT_FOUND") and not missing.exists()


def test_import_creates_a_new_sqlite_journal(capsys, tmp_path):
    url = f"sqlite:///{tmp_path / 'new.db'}"
    code, _, _ = cli(capsys, "import", "--db", url, str(FIXTURES / "two_request_trajectory.jsonl"))
    assert code == 0
    with sqlite3.connect(tmp_path / "new.db") as conn:
        assert conn.execute("SELECT count(*) FROM kvl_events").fetchone()[0] == 21
    with open_or_create_journal(url) as journal:
        assert replay_journal(journal, WINDOW).peaks["physical"].value == 1072


def test_the_commands_are_registered():
    from kvledger.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {"replay", "verify", "export", "import"} <= set(sub.choices)


def test_progress_on_a_terminal_does_not_change_the_output(capsys, monkeypatch):
    path = str(FIXTURES / "saved_work_p2048_g128.jsonl")
    _, plain, _ = cli(capsys, "replay", "--journal", path, "--json")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    code, shown, _ = cli(capsys, "replay", "--journal", path, "--json")
    assert code == 0 and shown == plain
