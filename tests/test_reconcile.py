"""`kvledger reconcile` on the checked-in telemetry fixtures: the clean demo run gives no
finding; each mutated copy gives exactly its class of finding, pointing at the mutated
record, and nothing else."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from kvledger.cli import main
from kvledger.migrations.storage import init_database, open_or_create_journal
from kvledger.replay.archive import import_jsonl
from kvledger.replay.reconcile import reconcile
from kvledger.replay.sources import jsonl_bodies, jsonl_events
from kvledger.schemas.telemetry import FINDING_CLASS, ReconcileCode

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "telemetry"
EXPECTED = json.loads((FIX / "expected.json").read_text())


def _run(telemetry: str | Path, metrics: str | Path | None = "metrics.txt", journal=None):
    scrape = (FIX / metrics).read_text() if metrics else None
    events = journal if journal is not None else jsonl_events(FIX / "journal.jsonl")
    return reconcile(events, jsonl_bodies(FIX / telemetry), scrape)


def _lines(telemetry: str) -> list[dict]:
    return [json.loads(line) for line in (FIX / telemetry).read_text().splitlines()]


def test_clean_fixture_has_no_finding():
    result = _run("telemetry.jsonl")
    assert result.findings == [] and result.ok
    s = result.summary
    assert s.complete and s.journal_events == s.in_scope == s.paired == s.mutations > 50
    assert s.observations > 40 and s.metric_series >= 90 and s.duplicates == 0


def test_every_class_has_a_mutated_fixture():
    classes = {e["class"] for e in EXPECTED.values()}
    assert classes >= {"unpublished_success", "lost_audit", "duplicate_delivery", "duplicate_corruption",
                       "stale_generation", "impossible_ordering", "unbounded_label",
                       "finish_counted_as_free", "plane_drift", "sampled"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_mutated_fixture_yields_exactly_its_class(name):
    exp = EXPECTED[name]
    result = _run(exp["telemetry"], exp["metrics"])
    assert result.findings, f"{name}: no finding"
    assert {f.finding_class for f in result.findings} == {exp["class"]}, result.findings
    assert {f.code for f in result.findings} == set(exp["codes"]), result.findings
    for f in result.findings:
        assert f.finding_class == FINDING_CLASS[ReconcileCode(f.code)]
        seq = exp["local_sequence"]
        points = (
            (exp["line"] is not None and exp["line"] in f.lines)
            or (exp["record_id"] is not None and exp["record_id"] in f.record_ids)
            or (exp["event_id"] is not None and exp["event_id"] in f.event_ids)
            or (seq is not None and f.sequences and f.sequences[0] <= seq <= f.sequences[-1])
            or (exp["scrape_line"] is not None and exp["scrape_line"] in f.scrape_lines))
        assert points, f"{name}: {f} does not point at the mutated record"
    info_only = exp["class"] in ("duplicate_delivery", "sampled")
    assert result.ok == info_only


def test_mutated_line_is_the_only_difference():
    """Each copy differs from the clean file in one record (or one scrape line): a
    mutation that changed two records could hide a second finding class."""
    clean = (FIX / "telemetry.jsonl").read_text().splitlines()
    for name, exp in EXPECTED.items():
        if exp["telemetry"] == "telemetry.jsonl" or name == "sampled":
            continue
        copy = (FIX / exp["telemetry"]).read_text().splitlines()
        added, removed = Counter(copy) - Counter(clean), Counter(clean) - Counter(copy)
        # one record inserted, removed, or replaced
        assert sum(added.values()) + sum(removed.values()) in (1, 2), name
        assert sum(added.values()) <= 1 and sum(removed.values()) <= 1, name


def test_lost_audit_finding_names_the_journal_event_of_the_missing_record():
    exp = EXPECTED["lost_audit"]
    [lost] = [f for f in _run(exp["telemetry"]).findings if f.code == "LOST_AUDIT"]
    assert lost.event_ids == (exp["event_id"],)
    positions = {e.event_id: e.global_position for e in jsonl_events(FIX / "journal.jsonl")}
    assert lost.positions == (positions[exp["event_id"]],)


def test_duplicate_delivery_is_counted_once():
    result = _run(EXPECTED["duplicate_delivery"]["telemetry"])
    clean = _run("telemetry.jsonl")
    assert result.summary.duplicates == 1
    assert result.summary.paired == clean.summary.paired
    assert result.summary.mutations == clean.summary.mutations


def test_sampled_stream_never_concludes_absence():
    exp = EXPECTED["sampled"]
    result = _run(exp["telemetry"])
    assert not result.summary.complete and result.summary.sample_rate == 0.5
    assert [f.code for f in result.findings] == ["SAMPLED_NO_ABSENCE"] and result.ok
    # the same loss in a stream declared complete is lost audit
    lines = _lines(exp["telemetry"])
    lines[0]["sample_rate"] = 1.0
    bodies = [(i, msgspec.json.encode(r)) for i, r in enumerate(lines, 1)]
    full = reconcile(jsonl_events(FIX / "journal.jsonl"), bodies)
    assert {f.finding_class for f in full.findings} == {"lost_audit"}
    assert sum(1 for f in full.findings if f.code == "LOST_AUDIT") == result.findings[0].count


def test_no_header_declares_nothing_complete():
    lines = _lines("telemetry.jsonl")[1:]
    lines = [r for r in lines if r.get("event_type") != "output_emit"]
    bodies = [(i, msgspec.json.encode(r)) for i, r in enumerate(lines, 1)]
    result = reconcile(jsonl_events(FIX / "journal.jsonl"), bodies)
    assert [f.code for f in result.findings] == ["SAMPLED_NO_ABSENCE"] and result.ok


def test_scope_excludes_events_outside_the_header():
    """Journal events before after_position, or from another source, are not lost audit."""
    events = list(jsonl_events(FIX / "journal.jsonl"))
    lines = _lines("telemetry.jsonl")
    first_release = next(e for e in events if e.event_type == "release").global_position
    lines[0]["after_position"] = first_release  # the file covers only what came after
    keep = {e.event_id for e in events if e.global_position > first_release}
    observed = {r["event_id"] for r in lines[1:] if r.get("caused_by_event_id") in keep}
    body = [lines[0]] + [r for r in lines[1:] if r.get("event_id") in keep | observed
                         or r["record"] == "trailer"]
    # renumber each source's sequence: a file that starts later is still gapless
    seq: dict[str, int] = {}
    for r in body[1:]:
        if "local_sequence" in r:
            seq[r["source_component"]] = seq.get(r["source_component"], 0) + 1
            r["local_sequence"] = seq[r["source_component"]]
    result = reconcile(iter(events), [(i, msgspec.json.encode(r)) for i, r in enumerate(body, 1)])
    assert result.findings == [] and result.summary.in_scope == len(keep)


def test_malformed_line_is_a_finding():
    bodies = list(jsonl_bodies(FIX / "telemetry.jsonl"))
    bodies.append((len(bodies) + 1, b'{"record":"mutation","event_id":'))
    result = reconcile(jsonl_events(FIX / "journal.jsonl"), bodies)
    assert [(f.code, f.lines) for f in result.findings] == [("MALFORMED_RECORD", (len(bodies),))]


# -- the command line ----------------------------------------------------------------------

def test_cli_clean_and_mutated(capsys):
    rc = main(["reconcile", "--telemetry", str(FIX / "telemetry.jsonl"), "--metrics",
               str(FIX / "metrics.txt"), "--journal", str(FIX / "journal.jsonl")])
    out = capsys.readouterr().out
    assert rc == 0 and "clean" in out
    exp = EXPECTED["finish_counted_as_free"]
    rc = main(["reconcile", "--telemetry", str(FIX / exp["telemetry"]), "--journal",
               str(FIX / "journal.jsonl"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1 and not doc["ok"]
    assert [f["code"] for f in doc["findings"]] == ["FINISH_COUNTED_AS_FREE"]
    assert doc["findings"][0]["lines"] == [exp["line"]]
    rc = main(["reconcile", "--telemetry", str(FIX / EXPECTED["unbounded_label"]["metrics"]), "--journal",
               str(FIX / "journal.jsonl")])
    assert rc == 1  # a scrape is not telemetry: every line is malformed
    capsys.readouterr()
    rc = main(["reconcile", "--telemetry", str(FIX / "telemetry.jsonl"), "--metrics",
               str(FIX / EXPECTED["unbounded_label"]["metrics"]), "--journal", str(FIX / "journal.jsonl")])
    out = capsys.readouterr().out
    assert rc == 1 and "UNBOUNDED_LABEL" in out and "request_id" in out


def test_cli_reads_a_database(tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/j.db"
    init_database(url)
    with open_or_create_journal(url) as journal:
        import_jsonl(journal, FIX / "journal.jsonl")
    rc = main(["reconcile", "--telemetry", str(FIX / "telemetry.jsonl"), "--db", url, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["findings"] == [] and doc["summary"]["paired"] == doc["summary"]["journal_events"]


def test_cli_bad_input_exits_2(tmp_path, capsys):
    assert main(["reconcile", "--telemetry", str(tmp_path / "nope.jsonl"), "--journal",
                 str(FIX / "journal.jsonl")]) == 2
    bad = tmp_path / "bad.txt"
    bad.write_text("kvledger_x{a=\n")
    assert main(["reconcile", "--telemetry", str(FIX / "telemetry.jsonl"), "--metrics", str(bad),
                 "--journal", str(FIX / "journal.jsonl")]) == 2
    assert main(["reconcile", "--telemetry", str(FIX / "telemetry.jsonl"), "--db",
                 f"sqlite:///{tmp_path}/missing.db"]) == 2
    err = capsys.readouterr().err
    assert "INVALID_ARGUMENT" in err and "DATABASE_NOT_FOUND" in err
    # --db or --journal is required: one coded line, as every refused argument
    assert main(["reconcile", "--telemetry", str(FIX / "telemetry.jsonl")]) == 2
    assert capsys.readouterr().err.startswith("INVALID_ARGUMENT: kvledger reconcile: ")
