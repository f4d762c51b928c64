"""`kvledger verify`: clean on the fixtures and on journals written by real commands;
finds each hand-made corruption (one broken invariant each) naming the right event."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from sqlalchemy import text
from test_replay_workload import write_workload

from kvledger import Ledger
from kvledger.cli import main
from kvledger.journal import make_engine, open_journal, parse_url
from kvledger.migrations.storage import open_or_create_journal as open_or_create
from kvledger.replay import import_jsonl, verify_bodies, verify_journal, verify_jsonl
from kvledger.schemas.canonical import canonical_json
from kvledger.schemas.receipts import receipt_decoder, receipt_encoder

from lifecycle_helpers import ManualClock

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
VALID = sorted(p.stem for p in FIXTURES.glob("*.jsonl"))
CORRUPT = json.loads((FIXTURES / "corrupt" / "expected.json").read_text())


def test_there_are_many_distinct_corruptions():
    assert len(CORRUPT) >= 10 and len({c["code"] for c in CORRUPT.values()}) == len(CORRUPT)


@pytest.mark.parametrize("name", VALID)
def test_fixtures_verify_clean(name):
    result = verify_jsonl(FIXTURES / f"{name}.jsonl")
    assert result.ok, result.findings
    assert result.events == len((FIXTURES / f"{name}.jsonl").read_text().splitlines())


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_each_corruption_is_found_at_its_event(name, capsys):
    want = CORRUPT[name]
    path = FIXTURES / "corrupt" / f"{name}.jsonl"
    findings = verify_jsonl(path).findings
    hits = [f for f in findings if f.code == want["code"]]
    assert hits, findings
    assert hits[0].global_position == want["global_position"]
    assert hits[0].event_id == want["event_id"]
    # nothing is reported before the broken event: the journal was clean up to it
    assert min(f.global_position for f in findings) == want["global_position"]
    code = main(["verify", "--journal", str(path), "--json"])
    out = msgspec.json.decode(capsys.readouterr().out)
    assert code == 1 and not out["ok"] and out["findings"][0]["code"] in {f.code for f in findings}


def test_verify_cli_clean_exit_0(capsys):
    assert main(["verify", "--journal", str(FIXTURES / "phase_trace.jsonl")]) == 0
    assert "21 events, every invariant holds" in capsys.readouterr().out


def test_an_undecodable_line_is_a_finding_with_its_line():
    lines = (FIXTURES / "runtime_trace.jsonl").read_bytes().splitlines()
    lines[3] = lines[3].replace(b'"output_index":0', b'"output_index":-1')
    rows = list(enumerate(lines, 1))
    findings = verify_bodies(rows).findings
    assert findings[0].code == "MALFORMED_EVENT" and findings[0].line == 4
    assert findings[0].global_position == 4 and findings[0].event_type == "output_emit"


def test_real_journals_verify_clean(db_url, capsys):
    clock = ManualClock()
    with Ledger.open(db_url, clock=clock) as led:
        write_workload(led, clock, seed=13, rounds=2)
        clock.at(5_000)
        write_workload(led, clock, seed=14, finish=False)  # requests still live at the end
        result = verify_journal(led.journal)
    assert result.ok, result.findings
    assert main(["verify", "--db", db_url]) == 0
    assert "every invariant holds" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["two_request_trajectory", "runtime_trace"])
def test_imported_fixtures_verify_clean_with_their_tables(db_url, name):
    with open_or_create(db_url) as journal:
        import_jsonl(journal, FIXTURES / f"{name}.jsonl")
        result = verify_journal(journal)
    assert result.ok, result.findings


def _sql(db_url: str, statement: str, **params) -> None:
    engine = make_engine(parse_url(db_url))
    try:
        with engine.begin() as conn:
            conn.execute(text(statement), params)
    finally:
        engine.dispose()


@pytest.fixture
def imported(db_url):
    with open_or_create(db_url) as journal:
        import_jsonl(journal, FIXTURES / "two_request_trajectory.jsonl")
        events = {e.global_position: e for e in journal.read_all()}
    return db_url, events


def _findings(db_url: str):
    with open_journal(db_url) as journal:
        return verify_journal(journal).findings


@pytest.mark.sql_storage("edits SQL rows in place: a NATS stream has no rows to edit")
def test_receipt_not_matching_its_events(imported):
    db_url, events = imported
    target = events[8]  # A's first decode: begin_append is its own operation
    with open_journal(db_url) as journal:
        receipt = journal.receipt(target.operation_id)
    forged = msgspec.structs.replace(receipt, event_ids=(events[9].event_id,))
    _sql(db_url, "UPDATE kvl_receipts SET body = :b WHERE operation_id = :o",
         b=receipt_encoder.encode(forged), o=target.operation_id)
    [f] = _findings(db_url)
    assert (f.code, f.global_position, f.event_id) == ("RECEIPT_MISMATCH", 8, target.event_id)


@pytest.mark.sql_storage("edits SQL rows in place: a NATS stream has no rows to edit")
def test_receipt_missing_and_handle_result_drift(imported):
    db_url, events = imported
    target = events[3]  # A's prefill publish
    _sql(db_url, "DELETE FROM kvl_receipts WHERE operation_id = :o", o=target.operation_id)
    publish = events[12]  # B's first decode publish
    with open_journal(db_url) as journal:
        receipt = journal.receipt(publish.operation_id)
    h = receipt.handles[0]
    drifted = msgspec.structs.replace(receipt, handles=(msgspec.structs.replace(h, committed_length=4),))
    _sql(db_url, "UPDATE kvl_receipts SET body = :b WHERE operation_id = :o",
         b=receipt_encoder.encode(drifted), o=publish.operation_id)
    found = {(f.code, f.global_position, f.event_id) for f in _findings(db_url)}
    assert found == {("RECEIPT_MISSING", 3, target.event_id),
                     ("RECEIPT_MISMATCH", 12, publish.event_id)}
    assert receipt_decoder.decode(receipt_encoder.encode(drifted)).handles[0].committed_length == 4


@pytest.mark.sql_storage("edits SQL rows in place: a NATS stream has no rows to edit")
def test_head_row_not_matching_its_stream(imported):
    db_url, events = imported
    _sql(db_url, "UPDATE kvl_heads SET committed_length = 3 WHERE handle_id = 'B'")
    [f] = _findings(db_url)
    last_b = max(p for p, e in events.items() if e.stream_id == "B")
    assert (f.code, f.global_position, f.stream_id) == ("HEAD_MISMATCH", last_b, "B")


@pytest.mark.sql_storage("edits SQL rows in place: a NATS stream has no rows to edit")
def test_stored_manifest_not_matching_its_digest(imported):
    db_url, events = imported
    alloc = events[4]  # B's request_allocate
    m = alloc.payload.manifest
    tampered = canonical_json(msgspec.structs.replace(
        m, request_policy=msgspec.structs.replace(m.request_policy, max_new_tokens=7)))
    _sql(db_url, "UPDATE kvl_manifests SET body = :b WHERE manifest_sha256 = :s",
         b=tampered, s=alloc.payload.manifest_sha256)
    [f] = _findings(db_url)
    assert (f.code, f.global_position, f.event_id) == ("DIGEST_MISMATCH", 4, alloc.event_id)


@pytest.mark.sql_storage("edits SQL rows in place: a NATS stream has no rows to edit")
def test_a_stored_row_at_the_wrong_position(imported, capsys):
    db_url, events = imported
    body = json.loads(msgspec.json.encode(events[6]))
    body["global_position"] = 60  # the envelope disagrees with the row it is stored in
    _sql(db_url, "UPDATE kvl_events SET body = :b WHERE global_position = 6",
         b=json.dumps(body, separators=(",", ":")).encode())
    findings = _findings(db_url)
    # the row's global_position column disagrees with its envelope, then the sequence has a gap
    assert findings[0].code == "COLUMN_MISMATCH" and findings[0].event_id == events[6].event_id
    assert "POSITION_GAP" in {f.code for f in findings}
    assert main(["verify", "--db", db_url]) == 1
    assert "COLUMN_MISMATCH" in capsys.readouterr().out
