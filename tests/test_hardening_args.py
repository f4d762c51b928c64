"""Issue 17, classes 1, 13, 16 and 19: what a user types on the command line.

1. No output path may resolve to the command's database (or its -wal/-shm/-journal) or
   to another input: OUTPUT_IS_INPUT, and the journal is byte-identical.
13. Every numeric and path argument is range-checked when parsed: one coded line on
   stderr, exit 2, no traceback, the journal byte-identical; outputs are probed for
   writability before the work starts, and a write that fails later is coded too.
16. A demo's summary counts only its own run's events, whatever else writes meanwhile.
19. `generate` prefills in chunks and refuses a prompt beyond the model's context.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from test_hardening_api import prefilled, snapshot

from kvledger import Ledger
from kvledger.cli import main
from kvledger.migrations.storage import open_or_create_journal

from factories import make_manifest

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 2048  # the default model's max_position_embeddings


@pytest.fixture
def journal(db_url):
    """A journal with a little history: two requests, one finished."""
    with Ledger.open(db_url) as ledger:
        base = prefilled(ledger, "h")
        ledger.emit("h", base=base, output_index=0, token_id=3)
        ledger.finish("h", base=base[0])
        prefilled(ledger, "k")
    return db_url


def sqlite_path(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///"))


def fingerprint(url: str):
    with Ledger.open(url) as ledger:
        return snapshot(ledger, url)


def refused(capsys, argv: list[str], code: str) -> str:
    """Run the CLI in this process; it must exit 2 with one line that starts with `code`."""
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 2, (argv, out, err)
    assert err.count("\n") == 1 and err.startswith(f"{code}: "), err
    assert "Traceback" not in out + err
    return err


# -- 1. outputs never overwrite the database or an input ---------------------------------

def _companions(db: Path, tmp_path: Path) -> dict[str, str]:
    link = tmp_path / "link.db"
    link.symlink_to(db)
    hard = tmp_path / "hard.db"
    os.link(db, hard)
    rel = os.path.relpath(db)
    return {"file": str(db), "relative": rel, "-wal": f"{db}-wal", "-shm": f"{db}-shm",
            "-journal (absent)": f"{db}-journal", "symlink": str(link), "hard link": str(hard),
            "dotted": f"{db.parent}/./{db.name}"}


@pytest.mark.parametrize("which", ["file", "relative", "-wal", "-shm", "-journal (absent)", "symlink",
                                   "hard link", "dotted"])
@pytest.mark.parametrize("backend", ["sqlite"])
def test_export_onto_the_database_is_refused(journal, capsys, tmp_path, which):
    db = sqlite_path(journal)
    with Ledger.open(journal) as ledger:  # a live writer keeps -wal and -shm in place
        before = snapshot(ledger, journal)
        target = _companions(db, tmp_path)[which]
        refused(capsys, ["export", "--db", journal, "--out", target], "OUTPUT_IS_INPUT")
        assert snapshot(ledger, journal) == before
        assert ledger.state("h").lifecycle == "FINISHED"


@pytest.mark.parametrize("backend", ["sqlite"])
def test_every_command_that_writes_refuses_its_inputs(journal, capsys, tmp_path, monkeypatch):
    db = str(sqlite_path(journal))
    before = fingerprint(journal)
    exported = tmp_path / "audit.jsonl"
    assert main(["export", "--db", journal, "--out", str(exported)]) == 0
    capsys.readouterr()
    for argv in (
        ["replay", "--db", journal, "--plot", db],
        ["replay", "--journal", str(exported), "--plot", str(exported)],
        ["demo", "--db", journal, "--telemetry", f"{db}-wal"],
        ["demo", "--db", journal, "--metrics-out", db],
        ["demo", "--db", journal, "--telemetry", str(tmp_path / "t"), "--metrics-out", str(tmp_path / "t")],
    ):
        code = "INVALID_ARGUMENT" if argv[-1] == str(tmp_path / "t") else "OUTPUT_IS_INPUT"
        refused(capsys, argv, code)
    monkeypatch.setenv("KVLEDGER_DB", journal)  # the default database is protected the same way
    refused(capsys, ["export", "--out", db], "OUTPUT_IS_INPUT")
    assert fingerprint(journal) == before


def test_export_to_a_new_file_still_works(journal, capsys, tmp_path):
    out = tmp_path / "fine.jsonl"
    assert main(["export", "--db", journal, "--out", str(out)]) == 0
    assert len(out.read_bytes().splitlines()) > 5


# -- 13. argument values outside the sane range --------------------------------------------

def _bad_model(tmp_path: Path) -> str:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))  # incomplete
    return str(d)


def _not_json_model(tmp_path: Path) -> str:
    d = tmp_path / "model2"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    return str(d)


BAD_ARGS = {
    # name: (argv after the command name, code)
    "seed beyond 64 bits": (["demo", "--seed", str(1 << 64)], "INVALID_ARGUMENT"),
    "negative seed": (["demo", "--seed", "-1"], "INVALID_ARGUMENT"),
    "seed not an integer": (["demo", "--seed", "1e3"], "INVALID_ARGUMENT"),
    "max-new-tokens 10**9": (["demo", "--max-new-tokens", str(10**9)], "INVALID_ARGUMENT"),
    "zero requests": (["demo", "--requests", "0"], "INVALID_ARGUMENT"),
    "device bogus": (["demo", "--device", "bogus"], "INVALID_ARGUMENT"),
    "device cuda without CUDA": (["generate", "--prompt-ids", "1,2", "--device", "cuda:0"], "INVALID_ARGUMENT"),
    "incomplete config.json": (["demo", "--model", "BAD_MODEL"], "INVALID_ARGUMENT"),
    "config.json not JSON": (["generate", "--prompt-ids", "1", "--model", "NOT_JSON_MODEL"], "INVALID_ARGUMENT"),
    "model directory missing": (["recover", "--model", "TMP/nowhere"], "INVALID_ARGUMENT"),
    "recover on device bogus": (["recover", "--device", "gpu"], "INVALID_ARGUMENT"),
    "metrics port 70000": (["demo", "--metrics-port", "70000"], "INVALID_ARGUMENT"),
    "demo SLO nan": (["demo", "--slo-ttft-ms", "nan"], "INVALID_ARGUMENT"),
    "window-ms nan": (["replay", "--window-ms", "nan"], "INVALID_ARGUMENT"),
    "window-ms inf": (["replay", "--window-ms", "inf"], "INVALID_ARGUMENT"),
    "window-start-ms negative": (["replay", "--window-start-ms", "-5"], "INVALID_ARGUMENT"),
    "slo beyond int64 ns": (["replay", "--slo-tbt-ms", "1e300"], "INVALID_ARGUMENT"),
    "at beyond 64 bits": (["replay", "--at", str(1 << 64)], "INVALID_ARGUMENT"),
    "at negative": (["replay", "--at", "-1"], "INVALID_ARGUMENT"),
    "checkpoint name too long": (["replay", "--incremental", "--checkpoint", "c" * 200], "INVALID_ARGUMENT"),
    "checkpoint name with a newline": (["replay", "--incremental", "--checkpoint", "a\nb"], "INVALID_ARGUMENT"),
    "crash-test zero trials": (["crash-test", "--trials", "0"], "INVALID_ARGUMENT"),
    "crash-test seed beyond 64 bits": (["crash-test", "--seed", str(1 << 70)], "INVALID_ARGUMENT"),
    "prompt ids not integers": (["generate", "--prompt-ids", "1,x"], "INVALID_ARGUMENT"),
    "prompt ids negative": (["generate", "--prompt-ids", "1,-2"], "INVALID_ARGUMENT"),
    "generation beyond the context": (["generate", "--prompt-ids", "1,2", "--max-new-tokens", "5000"],
                                      "CONTEXT_TOO_LONG"),
    "demo generation beyond the context": (["demo", "--max-new-tokens", "3000"], "CONTEXT_TOO_LONG"),
    "plot into a directory": (["replay", "--plot", "TMP"], "UNWRITABLE_OUTPUT"),
    "plot on a full disk": (["replay", "--plot", "/dev/full"], "UNWRITABLE_OUTPUT"),
    "plot in a read-only place": (["replay", "--plot", "/sys/kernel/kvledger.png"], "UNWRITABLE_OUTPUT"),
    "export into a directory": (["export", "--out", "TMP"], "UNWRITABLE_OUTPUT"),
    "export on a full disk": (["export", "--out", "/dev/full"], "UNWRITABLE_OUTPUT"),
    "export into a missing directory": (["export", "--out", "TMP/missing/x.jsonl"], "UNWRITABLE_OUTPUT"),
    "export in a read-only place": (["export", "--out", "/sys/kernel/x.jsonl"], "UNWRITABLE_OUTPUT"),
    "telemetry into a directory": (["demo", "--telemetry", "TMP"], "UNWRITABLE_OUTPUT"),
    "telemetry on a full disk": (["demo", "--telemetry", "/dev/full"], "UNWRITABLE_OUTPUT"),
    "telemetry in a read-only place": (["demo", "--telemetry", "/sys/kernel/t.jsonl"], "UNWRITABLE_OUTPUT"),
    # checked before the run, not after it
    "metrics-out into a directory": (["demo", "--metrics-out", "TMP"], "UNWRITABLE_OUTPUT"),
    "metrics-out on a full disk": (["demo", "--metrics-out", "/dev/full"], "UNWRITABLE_OUTPUT"),
    "metrics-out in a read-only place": (["demo", "--metrics-out", "/sys/kernel/m.txt"], "UNWRITABLE_OUTPUT"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_out_of_range_argument_is_one_coded_line(journal, capsys, tmp_path, case):
    argv, code = BAD_ARGS[case]
    subst = {"TMP": str(tmp_path), "BAD_MODEL": _bad_model(tmp_path), "NOT_JSON_MODEL": _not_json_model(tmp_path)}
    argv = [subst.get(x, x.replace("TMP", str(tmp_path))) for x in argv]
    before = fingerprint(journal)
    refused(capsys, [argv[0], "--db", journal, *argv[1:]], code)
    assert fingerprint(journal) == before


def test_a_write_that_fails_later_is_coded_and_leaves_nothing(tmp_path):
    """The disk fills during the export (a file size limit stands in for it): one coded
    line, exit 2, no partial file, the journal untouched."""
    url = f"sqlite:///{tmp_path}/big.db"
    with Ledger.open(url) as ledger:
        for i in range(120):  # well over the 64 KiB allowed below
            ledger.allocate(f"h{i}", make_manifest(f"h{i}", prompt=tuple(range(40))), reserved_capacity=64)
    before = fingerprint(url)
    out = tmp_path / "export.jsonl"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    r = subprocess.run([sys.executable, "-m", "kvledger", "export", "--db", url, "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, preexec_fn=limit, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("UNWRITABLE_OUTPUT: "), r.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert fingerprint(url) == before


# -- 16. a demo's summary is its own ---------------------------------------------------------

def _foreign_request(ledger: Ledger, handle: str) -> None:
    """A whole request by another writer: it would count as completed in a mixed summary."""
    base = prefilled(ledger, handle)
    ledger.emit(handle, base=base, output_index=0, token_id=1)
    ledger.finish(handle, base=base[0])


def test_demo_summary_counts_only_its_own_run(db_url):
    from kvledger.cmd_serve import summarize
    from kvledger.demo import DemoOptions, run_demo

    with open_or_create_journal(db_url) as journal, Ledger.open(db_url, source_instance="other-demo") as other:
        first = journal.last_position()
        _foreign_request(other, "other-1")  # the other run wrote before, during ...
        result = run_demo(journal, DemoOptions(requests=6, max_new_tokens=4, seed=1, run_id="mine",
                                               source_instance="kvledger-demo-mine"),
                          on_step=lambda w: w.step_no == 2 and _foreign_request(other, "other-2"))
        _foreign_request(other, "other-3")  # ... and after this run
        summary = summarize(journal, first, 1000.0, 250.0, "kvledger-demo-mine")
        mine = [e for e in journal.read_all(after=first) if e.source_instance == "kvledger-demo-mine"]
        theirs = journal.last_position() - first - len(mine)
    assert not result["errors"]
    assert theirs == 3 * 5  # the other run really wrote inside this run's window: 3 requests of 5 events
    assert summary["events_written"] == len(mine)
    # every own request that finished (the demo cancels one), no foreign one; its n=2 fork is not a
    # request of its own (issue 44: this counted handles, the fork as one more completed request)
    assert result["handles"] == result["requests"] + 1
    assert summary["goodput"]["completed"] == result["requests"] - summary["cancelled"] > 0
    assert {e.stream_id for e in mine}.isdisjoint({"other-1", "other-2", "other-3"})


# -- 19. generate: chunked prefill, bounded by the context -------------------------------------

@pytest.mark.parametrize("backend", ["sqlite"])
def test_generate_refuses_a_prompt_beyond_the_context_quickly(journal, capsys):
    before = fingerprint(journal)
    ids = ",".join(["7"] * 40_000)
    err = refused(capsys, ["generate", "--db", journal, "--prompt-ids", ids], "CONTEXT_TOO_LONG")
    assert str(CONTEXT) in err
    assert fingerprint(journal) == before


@pytest.mark.parametrize("backend", ["sqlite"])
def test_generate_prefills_a_long_prompt_in_chunks(db_url, capsys):
    prompt = [(i * 7) % 500 for i in range(CONTEXT - 9)]  # fills the context with 8 new tokens
    code = main(["generate", "--db", db_url, "--json", "--prompt-ids", ",".join(map(str, prompt)),
                 "--max-new-tokens", "8"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and len(out["output_ids"]) == 8
    with open_or_create_journal(db_url) as journal:
        starts = [e.payload for e in journal.read_all() if e.event_type == "append_start"
                  and e.payload.kind in ("prefill", "chunk")]
    assert [p.interval_count for p in starts] == [512, 512, 512, 503]
    assert [p.interval_start for p in starts] == [0, 512, 1024, 1536]


@pytest.mark.parametrize("argv, says", [
    ([], "required: COMMAND"),
    (["nosuch"], "invalid choice: 'nosuch'"),
    (["replay", "--bogus"], "unrecognized arguments: --bogus"),
    (["kv-events", "record"], "kvledger kv-events record: one of the arguments --endpoint --bind is required"),
    (["generate", "--runtime", "vllm", "--prompt-ids", "1"], "invalid choice: 'vllm'"),
    (["verify", "--max-findings"], "expected one argument"),
])
def test_argparse_refusals_are_one_coded_line(tmp_path, monkeypatch, capsys, argv, says):
    """What argparse itself refuses (an unknown command or option, a missing one, a bad
    choice) is one INVALID_ARGUMENT line naming the command, exit 2, no usage text and
    nothing created: a script tells it from any other refusal by its code."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "usage:" not in err, err
    assert err.startswith("INVALID_ARGUMENT: kvledger") and says in err, err
    assert not list(tmp_path.iterdir())


# argv after --db, the files it names (TMP/NAME: written first) -> what the line says
CONFLICTS = {
    "incremental at a position": (["replay", "--incremental", "--at", "5"], {}, "not with --journal or --at"),
    "incremental with a trajectory": (["replay", "--incremental", "--trajectory"], {}, "replay in full"),
    "reconcile of nothing": (["reconcile"], {}, "takes --telemetry or --kv-index (one of them)"),
    "reconcile of both": (["reconcile", "--telemetry", "TMP/t.jsonl", "--kv-index", "TMP/i.json"],
                          {"t.jsonl": "", "i.json": "{}"}, "(one of them)"),
    "an --at for telemetry": (["reconcile", "--telemetry", "TMP/t.jsonl", "--at", "3"], {"t.jsonl": ""},
                              "--at is for --kv-index"),
    "metrics not readable": (["reconcile", "--telemetry", "TMP/t.jsonl", "--metrics", "TMP/none.txt"],
                             {"t.jsonl": ""}, "cannot read"),
    "a kv index not there": (["reconcile", "--kv-index", "TMP/none.json"], {}, "cannot read"),
    "a kv index of no streams": (["reconcile", "--kv-index", "TMP/i.json"], {"i.json": "[]"}, "expected {\"streams\""),
    "a kv index at -1": (["reconcile", "--kv-index", "TMP/i.json"], {"i.json": '{"streams": {}, "position": -1}'},
                         "position must be an integer >= 0"),
    "a kv stream not an object": (["reconcile", "--kv-index", "TMP/i.json"], {"i.json": '{"streams": {"s": 5}}'},
                                  "stream 's': expected"),
    "a kv block's media not strings": (["reconcile", "--kv-index", "TMP/i.json"],
                                       {"i.json": '{"streams": {"s": {"h": [1]}}}'}, "media must be a list of strings"),
    "a kv index past the journal": (["reconcile", "--kv-index", "TMP/i.json", "--at", "999"],
                                    {"i.json": '{"streams": {}}'}, "position 999 is past the end"),
}


@pytest.mark.parametrize("case", list(CONFLICTS))
def test_arguments_that_do_not_go_together_are_one_line_saying_why(journal, capsys, tmp_path, case):
    argv, files, says = CONFLICTS[case]
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = [x.replace("TMP", str(tmp_path)) for x in argv]
    before = fingerprint(journal)
    line = refused(capsys, [argv[0], "--db", journal, *argv[1:]], "INVALID_ARGUMENT")
    assert says in line, line
    assert fingerprint(journal) == before
