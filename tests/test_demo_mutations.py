"""The main job's journal holds every mutation kvledger exists for, at any request count;
the two that need the worker's own handling (a failed forward call, a beam-style
reorder) are real: a failure ends the call's appends and they run again, a reorder
moves each handle's K/V rows with it. The demo's client (kvledger.scenario) asks for
them through the worker's public API only."""

from __future__ import annotations

import json

import pytest
import torch

from kvledger.cli import main
from kvledger.demo import SCENARIOS
from kvledger.migrations.storage import open_or_create_journal
from kvledger.replay import verify_journal
from kvledger.scenario import Action, Script
from kvledger.worker.kvstore import KVStore
from kvledger.worker.model import DEFAULT_CONFIG
from kvledger.worker.reexec import reexecute
from kvledger.worker.serving import RequestSpec

from test_worker import _tokens, run_workload

EVENT_TYPES = {"request_allocate", "append_start", "append_publish", "failure", "output_emit", "fork",
               "truncate", "reorder", "cancel_request", "finish", "release"}
APPEND_KINDS = {"prefill", "chunk", "decode", "repair", "verify"}


def _demo_then_export(db_url, tmp_path, capsys, *args) -> tuple[dict, list[dict]]:
    assert main(["demo", "--db", db_url, "--json", *args]) == 0
    summary = json.loads(capsys.readouterr().out)
    out = tmp_path / "export.jsonl"
    assert main(["export", "--db", db_url, "--out", str(out)]) == 0
    return summary, [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.nats_case("a demo on a cell: tests/test_nats_journal.py; its sizes are the worker's matter")
@pytest.mark.parametrize("requests", [8, None, 64])
def test_demo_journal_holds_every_event_type_and_append_kind(db_url, tmp_path, capsys, requests):
    summary, events = _demo_then_export(db_url, tmp_path, capsys,
                                        *(["--requests", str(requests)] if requests else []))
    types = {e["event_type"] for e in events}
    kinds = {e["payload"]["kind"] for e in events if e["event_type"] == "append_start"}
    assert types == EVENT_TYPES
    assert kinds == APPEND_KINDS
    assert summary["errors"] == []
    # the summary counts what was written, by type and by append kind
    assert sum(summary["events_by_type"].values()) == summary["events_written"] == len(events)
    assert summary["events_by_type"]["failure"] == sum(e["event_type"] == "failure" for e in events)
    assert set(summary["appends_by_kind"]) == APPEND_KINDS
    assert main(["verify", "--db", db_url]) == 0


def test_a_small_demo_plays_the_scenarios_that_fit(tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/small.db"
    assert SCENARIOS[:3] == ("long", "fork", "cancel")
    _, events = _demo_then_export(url, tmp_path, capsys, "--requests", "3")
    types = {e["event_type"] for e in events}
    kinds = {e["payload"]["kind"] for e in events if e["event_type"] == "append_start"}
    assert {"fork", "reorder", "cancel_request"} <= types and "truncate" not in types
    assert kinds == {"prefill", "chunk", "decode"}


def test_reorder_moves_each_handles_rows_with_it():
    cfg = DEFAULT_CONFIG
    store = KVStore(cfg, slots=4, capacity=8)
    rows = ("a", "b", "c")
    for h in ("x", *rows):
        store.open(h, 8)
    store.k.normal_()
    store.v.normal_()
    for h, n in zip(("x", *rows), (3, 5, 2, 7)):
        store.commit(h, n)
    before = {h: store.read(h) for h in ("x", *rows)}
    slots = [store.slot[h] for h in rows]
    store.reorder(rows, (2, 0, 1))  # new row i <- old row perm[i]
    assert [store.slot[h] for h in ("c", "a", "b")] == slots  # the group keeps its slots, in row order
    for h, (k, v) in before.items():  # every handle's visible rows are unchanged, the outsider's too
        k2, v2 = store.read(h)
        assert torch.equal(k, k2) and torch.equal(v, v2), h


def test_a_reordered_fork_group_decodes_what_it_would_have(model, db_url, tmp_path):
    """Sampling is seeded per handle and output index, so a reorder changes no output:
    if the store's rows did not follow the permutation, the swapped beams would attend
    over each other's K/V and sample something else."""
    spec = RequestSpec(request_id="beam", prompt=_tokens(9, seed=2), max_new_tokens=10, n=2, temperature=0.8,
                       seed=5)
    plain, _ = run_workload(f"sqlite:///{tmp_path}/plain.db", [spec], model)
    out, events = run_workload(db_url, [spec], model,
                               script=Script((Action("beam", "reorder", after=3, permutation=(1, 0)),)))
    assert out == plain and out["beam"] != out["beam.1"]
    moves = [e for e in events if e.event_type == "reorder"]
    assert {(e.stream_id, e.payload.row_index) for e in moves} == {("beam", 1), ("beam.1", 0)}
    assert all(e.payload.permutation == (1, 0) and e.payload.rows == ("beam", "beam.1") for e in moves)
    # the reorder came once each row had three outputs, in one operation
    assert len({e.operation_id for e in moves}) == 1
    outputs = {h: [e for e in events if e.stream_id == h and e.event_type == "output_emit"
                   and e.global_position < moves[0].global_position] for h in ("beam", "beam.1")}
    assert all(len(v) >= 3 for v in outputs.values())
    with open_or_create_journal(db_url) as j:
        assert verify_journal(j).findings == []
    r = reexecute(model, events, capacity=64)
    assert r.mismatches == [] and r.verified_rows > 0


def test_a_failed_forward_call_ends_its_appends_and_they_run_again(model, db_url, tmp_path):
    """The injected fault raises after the call staged its rows: every append of that
    call ends in a failure event, its rows are dropped, and it runs again; the outputs
    are those of a run without the fault, and re-execution reproduces every row."""
    specs = [RequestSpec(request_id=f"r{i}", prompt=_tokens(5 + 3 * i, seed=i), max_new_tokens=6) for i in range(3)]
    clean, _ = run_workload(f"sqlite:///{tmp_path}/clean.db", specs, model)
    out, events = run_workload(db_url, specs, model, script=Script((Action("r1", "fault", after=2),)))
    assert out == clean
    failures = [e for e in events if e.event_type == "failure"]
    assert {e.stream_id for e in failures} == {"r0", "r1", "r2"}  # one decode call held all three
    assert all(e.payload.outcome == "failed" and e.payload.code == "FORWARD_FAILED"
               and "injected fault" in e.payload.detail for e in failures)
    failed_txns = {e.payload.txn_id for e in failures}
    assert not any(e.event_type == "append_publish" and e.payload.txn_id in failed_txns for e in events)
    with open_or_create_journal(db_url) as j:
        assert verify_journal(j).findings == []
    r = reexecute(model, events, capacity=64)
    assert r.mismatches == [] and not r.skipped


def test_a_request_whose_calls_keep_failing_is_cancelled_and_released(model, tmp_path):
    from kvledger.engine.service import CommandService
    from kvledger.worker.loading import load_model
    from kvledger.worker.serving import Worker

    url = f"sqlite:///{tmp_path}/give-up.db"
    _, artifact = load_model()
    with open_or_create_journal(url) as j:
        w = Worker(model, service=CommandService(j), artifact=artifact, capacity=32, retries=0)
        w.submit(RequestSpec(request_id="g", prompt=_tokens(6), max_new_tokens=4))
        Script((Action("g", "fault", after=1),)).play(w)
        assert len(w.errors) == 1 and "g: forward call failed 1 times" in w.errors[0]  # not served
        types = [e.event_type for e in j.read_all()]
        assert types[-3:] == ["failure", "cancel_request", "release"]
        assert verify_journal(j).findings == []
