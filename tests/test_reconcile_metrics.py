"""`reconcile --metrics` checks the scrape's values against the journal: every value the
journal proves (events by type, append attempts and journal-decided outcomes, running and
waiting requests, KV byte ledgers, the latency histograms, the position the scrape counts
to) is compared, and the summary lists what was checked for its labels only."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.cli import main
from kvledger.demo import DemoOptions, run_demo
from kvledger.migrations.storage import open_or_create_journal
from kvledger.replay.metric_proof import family, parse_scrape
from kvledger.replay.reconcile import reconcile
from kvledger.replay.sources import journal_events, jsonl_bodies, jsonl_events
from kvledger.schemas.errors import KvLedgerError
from kvledger.telemetry.producer import Telemetry

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "telemetry"
CLEAN = (FIX / "metrics.txt").read_text()
# Values a demo's scrape carries that the journal cannot prove: refusals write nothing,
# the rest count the telemetry pipeline itself.
LABELS_ONLY = ('kvledger_append_outcomes{outcome="conflict"}', 'kvledger_append_outcomes{outcome="rejected"}',
               'kvledger_append_outcomes{outcome="stale"}', "kvledger_command_rejections",
               "kvledger_telemetry_dropped_records", "kvledger_telemetry_queue_depth", "kvledger_telemetry_records")


def _fixture(scrape: str, telemetry: str = "telemetry.jsonl"):
    return reconcile(jsonl_events(FIX / "journal.jsonl"), jsonl_bodies(FIX / telemetry), scrape)


def _changed(text: str, series: str, delta: float = 1.0) -> tuple[str, int]:
    """The scrape with `series` (a sample line's name and labels) off by delta; its line."""
    lines = text.splitlines()
    k = next(n for n, line in enumerate(lines) if line.rsplit(" ", 1)[0] == series)
    name, value = lines[k].rsplit(" ", 1)
    lines[k] = f"{name} {float(value) + delta!r}"
    return "\n".join(lines) + "\n", k + 1


def test_the_untouched_scrape_is_clean_and_says_what_was_proven():
    result = _fixture(CLEAN)
    s = result.summary
    assert result.findings == [] and result.ok
    assert s.metric_position == 63 and s.metric_values_proven >= 50
    assert s.metrics_labels_only == LABELS_ONLY
    assert "trailer" in s.metrics_scope  # the checked-in scrape predates its position gauge


@pytest.mark.parametrize(("series", "delta"), [
    ('kvledger_journal_events_total{event_type="output_emit"}', 1),
    ('kvledger_journal_events_total{event_type="truncate"}', 2),  # a type the run never wrote
    ('kvledger_append_attempts_total{kind="chunk"}', -1),
    ('kvledger_append_outcomes_total{outcome="success"}', 1),
    ('kvledger_append_outcomes_total{outcome="cancelled"}', 1),
    ("kvledger_requests_running", 1),
    ('kvledger_kv_bytes{ledger="physical"}', 4096),
    ('kvledger_time_to_first_token_seconds_bucket{le="+Inf"}', 1),
    ("kvledger_inter_token_latency_seconds_count", -1),
    ("kvledger_time_to_first_token_seconds_sum", 0.25),
])
def test_one_changed_value_is_one_finding_naming_it(series, delta):
    scrape, line = _changed(CLEAN, series, delta)
    result = _fixture(scrape)
    [f] = result.findings
    name, _, labels = series.partition("{")
    assert f.code == "METRIC_CONTRADICTS_JOURNAL" and f.finding_class == "metric_drift" and not result.ok
    assert f.metric == name and f.labels == ("{" + labels if labels else "") and f.scrape_lines == (line,)
    assert f.claimed == pytest.approx(f.proven + delta)
    assert f"{series} is " in f.message and "the journal proves" in f.message


def test_a_value_the_journal_cannot_prove_is_labels_only_and_said_so():
    for series in ('kvledger_append_outcomes_total{outcome="stale"}',
                   'kvledger_command_rejections_total{code="CONFLICT"}',
                   'kvledger_telemetry_records_total{source_component="allocator"}'):
        result = _fixture(_changed(CLEAN, series, 5)[0])
        assert result.findings == [] and result.summary.metrics_labels_only == LABELS_ONLY


def test_without_a_header_every_metric_is_labels_only():
    bodies = list(jsonl_bodies(FIX / "telemetry.jsonl"))[1:]
    result = reconcile(jsonl_events(FIX / "journal.jsonl"), bodies, _changed(CLEAN, "kvledger_requests_running")[0])
    assert result.findings == []  # a wrong value, but no scope to prove it in
    s = result.summary
    assert s.metric_values_proven == 0 and s.metric_position is None and "no telemetry header" in s.metrics_scope
    assert "kvledger_journal_events" in s.metrics_labels_only


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_changed_series_is_found_exactly_when_the_journal_proves_it(data):
    samples = parse_scrape(CLEAN)
    k = data.draw(st.integers(0, len(samples) - 1), label="series")
    delta = data.draw(st.sampled_from([1.0, -1.0, 7.0, 0.5, 1e6]), label="delta")
    s = samples[k]
    series = CLEAN.splitlines()[s.line - 1].rsplit(" ", 1)[0]
    result = _fixture(_changed(CLEAN, series, delta)[0])
    labels = series[len(s.name):]
    if family(s.name) in LABELS_ONLY or f"{family(s.name)}{labels}" in LABELS_ONLY:
        assert result.findings == []
    else:
        [f] = result.findings
        assert f.code == "METRIC_CONTRADICTS_JOURNAL" and f.scrape_lines == (s.line,)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=400))
def test_any_scrape_text_is_checked_or_refused_with_a_code(text):
    """A scrape is parsed before anything is proven: bad text is INVALID_ARGUMENT, never
    another exception, and a parsed one yields only metric findings."""
    if _parses(text):
        assert {f.code for f in _fixture(text).findings} <= {"METRIC_CONTRADICTS_JOURNAL", "UNBOUNDED_LABEL"}
    else:
        with pytest.raises(KvLedgerError, match="^INVALID_ARGUMENT: not a Prometheus text exposition"):
            _fixture(text)


def _parses(text: str) -> bool:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        list(text_string_to_metric_families(text))
    except Exception:  # noqa: BLE001 - the parser raises ValueError and friends: that is the answer
        return False
    return True


# -- a real demo, through the command line and mid-run --------------------------------------

def test_the_demo_scrape_is_proven_at_its_own_position_and_a_change_is_exit_1(db_url, tmp_path, capsys):
    tel, scrape = tmp_path / "t.jsonl", tmp_path / "m.txt"
    assert main(["demo", "--db", db_url, "--requests", "8", "--max-new-tokens", "4", "--json",
                 "--telemetry", str(tel), "--metrics-out", str(scrape)]) == 0
    position = json.loads(capsys.readouterr().out)["position"]
    argv = ["reconcile", "--db", db_url, "--telemetry", str(tel), "--json"]
    assert main([*argv, "--metrics", str(scrape)]) == 0
    doc = json.loads(capsys.readouterr().out)
    s = doc["summary"]
    assert doc["ok"] and s["metric_position"] == position and "kvledger_journal_position" in s["metrics_scope"]
    assert s["metric_values_proven"] >= 50 and tuple(s["metrics_labels_only"]) == LABELS_ONLY
    text = scrape.read_text()
    failed = float(re.search(r'kvledger_append_outcomes_total\{outcome="failed"\} (\S+)', text).group(1))
    assert failed >= 1  # the demo's injected forward fault: a value only the journal's failures prove
    wrong = tmp_path / "wrong.txt"
    wrong.write_text(_changed(text, 'kvledger_append_outcomes_total{outcome="failed"}', 1)[0])
    assert main([*argv, "--metrics", str(wrong)]) == 1
    [f] = json.loads(capsys.readouterr().out)["findings"]
    assert (f["code"], f["metric"], f["labels"]) == ("METRIC_CONTRADICTS_JOURNAL", "kvledger_append_outcomes_total",
                                                     '{outcome="failed"}')
    assert (f["claimed"], f["proven"]) == (failed + 1, failed)
    assert main(["reconcile", "--db", db_url, "--telemetry", str(tel), "--metrics", str(wrong)]) == 1
    out = " ".join(capsys.readouterr().out.split())  # rich wraps lines at any space
    assert "metric_drift" in out and "labels only: kvledger_append_outcomes" in out
    assert f"values of {s['metric_values_proven']} series proven against the journal" in out


def test_a_scrape_taken_mid_run_is_proven_at_the_position_it_names(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    scrapes: list[str] = []
    telemetry = Telemetry(tmp_path / "t.jsonl")

    def scrape(worker) -> None:
        if worker.step_no in (2, 5):
            scrapes.append(telemetry.metrics.scrape().decode())

    with open_or_create_journal(url) as journal:
        run_demo(journal, DemoOptions(requests=8, max_new_tokens=4, seed=1), telemetry=telemetry, on_step=scrape)
        telemetry.close()
        final = journal.last_position()
        for text in scrapes:
            result = reconcile(journal_events(journal), jsonl_bodies(tmp_path / "t.jsonl"), text)
            position = result.summary.metric_position
            assert result.ok and result.findings == [], result.findings
            assert 0 < position < final and f"up to {position}" in result.summary.metrics_scope
            # the same scrape said to count to the end of the run is short of the journal
            late = re.sub(r"^kvledger_journal_position \S+$", f"kvledger_journal_position {final}.0", text, flags=re.M)
            assert {f.metric for f in reconcile(journal_events(journal), jsonl_bodies(tmp_path / "t.jsonl"),
                                                late).findings} >= {"kvledger_journal_events_total"}
    assert len(scrapes) == 2
