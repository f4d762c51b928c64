"""Lookahead: Worker.run builds an iteration's batch while the last commit is in flight.

What it must keep: the journal a waiting worker writes (same events, same calls, same
rows), and, when the in-flight commit refuses a handle's command, the waiting worker's
outcome for that handle (it fails, with the outputs it had) and for every other one.
"""

from __future__ import annotations

import random
import time

import msgspec
import pytest

from kvledger import Ledger
from kvledger.demo import demo_workload
from kvledger.engine.remote import command_service
from kvledger.migrations.storage import open_or_create_journal
from kvledger.replay import verify_journal
from kvledger.scenario import Script
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.worker.loading import load_model
from kvledger.worker.reexec import reexecute
from kvledger.worker.serving import RequestSpec, Worker

# What an event says, less what differs between two runs of the same work: ids, times,
# the writer's instance, the call ids.
_RUN_SPECIFIC = {"event_id", "operation_id", "txn_id", "call_id", "wall_ns", "monotonic_ns",
                 "recorded_wall_ns", "idempotency_key", "source_instance", "causation_id", "correlation_id"}


def _said(event) -> tuple:
    payload = msgspec.to_builtins(event.payload)
    return (event.stream_id, event.event_type, _strip(payload))


def _strip(value):
    if isinstance(value, dict):
        # the txn ids a cancel aborts are run-specific like txn_id; how many it aborts is not
        return {k: len(v) if k == "aborted_txn_ids" else _strip(v)
                for k, v in value.items() if k not in _RUN_SPECIFIC}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _run(url, specs, model, *, lookahead, writer="thread", on_step=None, script=None):
    _, artifact = load_model()
    capacity = max(len(s.prompt) for s in specs) + max(s.max_new_tokens for s in specs) + 1
    with open_or_create_journal(url) as j, command_service(j, writer=writer) as service:
        w = Worker(model, service=service, artifact=artifact, capacity=capacity, pipeline=True,
                   lookahead=lookahead)
        for s in specs:
            w.submit(s)
        out = (script or Script()).play(w, on_step=on_step)
        events = list(j.read_all())
        assert verify_journal(j).findings == []
    return w, out, events


@pytest.mark.nats_case("the lookahead is the worker's: SQLite and PostgreSQL show it")
@pytest.mark.sqlite_case("the lookahead is the worker's: its writer process on SQLite", writer="process")
@pytest.mark.parametrize("writer", ["thread", "process"])
def test_lookahead_journals_what_a_waiting_worker_journals(model, db_url, tmp_path, writer):
    """Every scenario of the demo (chunked prefill, fork and reorder, cancel, truncate,
    repair, speculation, an injected fault and its retry): the same outputs, the same
    events in each stream, and rows that re-execute bit for bit."""
    specs, script = demo_workload(12, 8, seed=7, vocab=model.cfg.vocab_size)
    waited, a, before = _run(f"sqlite:///{tmp_path}/w.db", specs, model, lookahead=False, script=script)
    ahead, b, after = _run(db_url, specs, model, lookahead=True, writer=writer, script=script)
    assert waited.errors == ahead.errors == []
    assert a == b
    assert {e.event_type for e in after} >= {"fork", "reorder", "truncate", "failure", "cancel_request"}
    streams = sorted({e.stream_id for e in before})
    for s in streams:
        assert [_said(e) for e in before if e.stream_id == s] == [_said(e) for e in after if e.stream_id == s], s
    assert waited.step_no == ahead.step_no
    r = reexecute(model, after, capacity=256)
    assert r.verified_rows > 0 and r.mismatches == []


def _overtake(url: str, handle: str, at_outputs: int):
    """An on_step that, once `handle` has `at_outputs` outputs, has another writer move
    its head (a truncate to its committed length): the worker's next command on it is
    stale. Returns the hook and the list it records the truncate's position in."""
    done: list[int] = []
    other = Ledger.open(url, source_instance="other")

    def hook(w: Worker) -> None:
        if done or len(w.live[handle].outputs) < at_outputs:
            return
        # With lookahead the iteration's commit may still be in flight here: the move comes
        # after it, as it does when the worker waited for it (on a loaded machine a writer
        # process can be slower to commit than this hook is to write)
        for _ in range(1000):
            if len(other.state(handle).outputs) >= len(w.live[handle].outputs):
                break
            time.sleep(0.002)
        for _ in range(50):  # a commit of the worker's may land between the read and the write
            s = other.state(handle)
            try:
                other.truncate(handle, base=(s.generation, s.snapshot_version), new_length=s.committed_length)
            except KvLedgerError as exc:
                if exc.code is not ErrorCode.STALE_BASE:
                    raise
                continue
            done.append(other.state(handle).snapshot_version)
            return
        raise AssertionError("never got the truncate in")

    return hook, done, other


@pytest.mark.nats_case("the lookahead is the worker's: SQLite and PostgreSQL show it")
@pytest.mark.sqlite_case("the lookahead is the worker's: its writer process on SQLite", writer="process")
@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_refused_in_flight_command_fails_its_handle_as_waiting_would(model, db_url, tmp_path, writer):
    """Another writer overtakes handle "a" mid-run. Whether the refusal is read before
    or after the next batch is built, "a" ends failed with the same outputs, its
    staged rows are never published, the worker writes nothing more on it, and "b"
    runs to the end with the same tokens and events. Only the shape of b's next call
    differs: a batch built ahead keeps a's row in it as a placeholder (the shape its
    start was journaled with), so that call is recorded as size 2 and its rows (and
    those that attend to them) have other float bits; both journals re-execute bit for
    bit."""
    rng = random.Random(3)
    specs = [RequestSpec(request_id=h, prompt=tuple(rng.randrange(model.cfg.vocab_size) for _ in range(9)),
                         max_new_tokens=10) for h in ("a", "b")]
    results = {}
    for lookahead in (False, True):
        url = db_url if lookahead else f"sqlite:///{tmp_path}/w.db"
        hook, moved, other = _overtake(url, "a", 4)
        try:
            w, out, events = _run(url, specs, model, lookahead=lookahead, writer=writer, on_step=hook)
        finally:
            other.close()
        assert moved, "the other writer never moved the head"
        assert w.live["a"].done == "failed" and w.live["b"].done == "max_tokens"
        assert any("STALE_BASE" in e for e in w.errors)
        mine_after = [e for e in events if e.stream_id == "a" and e.source_instance != "other"
                      and e.global_position > next(x.global_position for x in events
                                                   if x.event_type == "truncate")]
        assert mine_after == [], [e.event_type for e in mine_after]
        committed = [e.payload.committed_length for e in events
                     if e.stream_id == "a" and e.event_type == "append_publish"]
        store = w.store
        assert "a" not in store.slot or store.pending["a"] == store.committed["a"] == committed[-1]
        r = reexecute(model, events, capacity=64)
        assert r.verified_rows > 0 and r.mismatches == []
        b = [_said(e) for e in events if e.stream_id == "b"]
        same = [(s, t, {k: v for k, v in p.items() if k not in ("call", "rows_sha256")}) for s, t, p in b]
        results[lookahead] = (out, w.errors, same)
    assert results[True] == results[False]
    assert len(results[True][0]["b"]) == 10
