"""Telemetry and metrics (issue 6): emitted only after the commit they describe, never
blocking the service or the worker, drops counted, bounded metric labels, and a demo's
own telemetry reconciling against its own journal with no finding on both backends."""

from __future__ import annotations

import contextlib
import errno
import json
import sys
import threading
import time
import urllib.request
from collections import Counter as Count
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvledger.cli import main
from kvledger.demo import DemoOptions, run_demo
from kvledger.engine import commands as c
from kvledger.engine.service import CommandService
from kvledger.journal import tuning
from kvledger.migrations.storage import init_database, open_or_create_journal
from kvledger.replay.reconcile import reconcile
from kvledger.replay.sources import journal_events, jsonl_bodies
from kvledger.replay.verify import verify_journal
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.telemetry import IDENTITY_LABELS, Header, Mutation, record_decoder
from kvledger.telemetry.exporter import Exporter
from kvledger.telemetry.metrics import Metrics
from kvledger.telemetry.producer import Telemetry
from kvledger.worker.serving import use_threads

from factories import make_manifest


def _records(path: Path, *, live: bool = False) -> list:
    """The file's records. `live`: the exporter may be mid-write, so a last line without
    its newline yet is not read (a tailing consumer does the same); otherwise every line
    must decode."""
    data = path.read_bytes()
    if live and not data.endswith(b"\n"):
        data = data[:data.rfind(b"\n") + 1]
    return [record_decoder.decode(line) for line in data.splitlines() if line.strip()]


def _scalar(scrape: bytes, name: str, **labels) -> float:
    for family in text_string_to_metric_families(scrape.decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"no sample {name} {labels}")


def _series_per_family(scrape: bytes) -> dict[str, int]:
    return {f.name: len(f.samples) for f in text_string_to_metric_families(scrape.decode())}


# -- the demo's own telemetry against its own journal -----------------------------------

@pytest.mark.parametrize("one_thread", [False, True], ids=["default", "lookahead"])
def test_demo_telemetry_reconciles_with_its_journal(db_url, tmp_path, one_thread):
    """With torch's whole pool, and with one thread, where the worker overlaps each
    commit with the model call and builds its next batch before applying the last
    (Worker.lookahead): receipts reach the observers an iteration later."""
    if one_thread and tuning.usable_cpus() < 2:
        pytest.skip("one usable CPU: a one-thread pool leaves no core to overlap with")
    path = tmp_path / "telemetry.jsonl"
    threads = torch.get_num_threads()
    with open_or_create_journal(db_url) as journal:
        telemetry = Telemetry(path)
        port = telemetry.serve(0)
        # the pool alone, not use_threads: no thread is moved (placement is process state)
        torch.set_num_threads(1 if one_thread else threads)
        try:
            result = run_demo(journal, DemoOptions(requests=6, max_new_tokens=3, seed=1), telemetry=telemetry)
        finally:
            torch.set_num_threads(threads)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            served = resp.read()
        telemetry.close()
        assert result["errors"] == []
        events = list(journal_events(journal))
        scrape = telemetry.metrics.scrape()
        rec = reconcile(iter(events), jsonl_bodies(path), scrape.decode())
    assert rec.findings == [], rec.findings[:5]
    s = rec.summary
    assert s.complete and s.paired == s.in_scope == len(events) and s.refused == 0
    assert telemetry.dropped == 0 and telemetry.stats()["written"] == s.mutations + s.observations
    # every observed event type got one allocator and one residency observation
    observed = sum(1 for e in events if e.event_type in
                   ("append_publish", "fork", "truncate", "cancel_request", "finish", "release"))
    assert s.observations == 2 * observed
    # each source's local_sequence is gapless from 1, in file order
    by_source: dict[str, list[int]] = {}
    for r in _records(path):
        if hasattr(r, "local_sequence"):
            by_source.setdefault(r.source_component, []).append(r.local_sequence)
    assert set(by_source) == {"command_service", "allocator", "residency"}
    assert all(seqs == list(range(1, len(seqs) + 1)) for seqs in by_source.values())
    # metrics agree with the journal they were counted from
    types = Count(e.event_type for e in events)
    assert b"kvledger_journal_events_total" in served
    for t in ("request_allocate", "append_start", "append_publish", "output_emit", "fork", "release"):
        assert _scalar(scrape, "kvledger_journal_events_total", event_type=t) == types[t]
    starts = Count(e.payload.kind for e in events if e.event_type == "append_start")
    for kind, n in starts.items():
        assert _scalar(scrape, "kvledger_append_attempts_total", kind=kind) == n
    assert _scalar(scrape, "kvledger_append_outcomes_total", outcome="success") == types["append_publish"]
    # TTFT once per allocated request that produced output; ITL for every later output
    outputs = Count(e.stream_id for e in events if e.event_type == "output_emit")
    firsts = sum(1 for e in events if e.event_type == "request_allocate" and outputs[e.stream_id])
    assert _scalar(scrape, "kvledger_time_to_first_token_seconds_count") == firsts
    assert _scalar(scrape, "kvledger_inter_token_latency_seconds_count") == types["output_emit"] - firsts
    for gauge in ("kvledger_requests_running", "kvledger_requests_waiting"):
        assert _scalar(scrape, gauge) == 0
    for ledger in ("logical", "reserved", "physical"):
        assert _scalar(scrape, "kvledger_kv_bytes", ledger=ledger) == 0  # everything released


def test_gauges_follow_live_handles(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    init_database(url)
    with open_or_create_journal(url) as journal:
        service = CommandService(journal)
        telemetry = Telemetry(None).attach(service)
        m = make_manifest(request_id="g1")
        service.execute(c.Allocate(handle_id="g1", manifest=m, reserved_capacity=8))
        scrape = telemetry.metrics.scrape()
        assert _scalar(scrape, "kvledger_requests_waiting") == 1
        assert _scalar(scrape, "kvledger_kv_bytes", ledger="reserved") == 0  # arrival owns nothing
        s = service.state("g1")
        service.execute(c.BeginAppend(handle_id="g1", txn_id="t", kind="prefill", base_generation=0,
                                      base_snapshot_version=0, interval_start=0, interval_count=4,
                                      token_ids=(11, 22, 33, 44), cache_positions=(0, 1, 2, 3),
                                      mask_key_extent=4, cache_abi_sha256=s.cache_abi_sha256))
        service.execute(c.Publish(handle_id="g1", txn_id="t", base_generation=0, base_snapshot_version=0))
        scrape = telemetry.metrics.scrape()
        assert _scalar(scrape, "kvledger_requests_waiting") == 0
        assert _scalar(scrape, "kvledger_requests_running") == 1
        assert _scalar(scrape, "kvledger_kv_bytes", ledger="logical") == 4 * s.b_token
        assert _scalar(scrape, "kvledger_kv_bytes", ledger="reserved") == 8 * s.b_token
        telemetry.close()


# -- never before the commit; refused commands; failed commits ---------------------------

@contextlib.contextmanager
def _traced_service(tmp_path: Path):
    """A command service on a fresh SQLite journal, with telemetry to t.jsonl attached."""
    url = f"sqlite:///{tmp_path}/j.db"
    init_database(url)
    with open_or_create_journal(url) as journal:
        service = CommandService(journal)
        yield journal, service, Telemetry(tmp_path / "t.jsonl").attach(service), tmp_path / "t.jsonl"


def test_records_are_enqueued_only_after_their_commit_returned(tmp_path):
    with _traced_service(tmp_path) as (journal, service, telemetry, path):
        committed: set[str] = set()
        real_append, real_put = journal.append, telemetry.exporter.put
        fail_next = {"on": False}

        def append(ops):
            if fail_next["on"]:
                fail_next["on"] = False
                raise KvLedgerError(ErrorCode.DATABASE_UNREACHABLE, "injected commit failure")
            results = real_append(ops)
            for r in results:
                if hasattr(r, "event_ids"):
                    committed.update(r.event_ids)
            return results

        early: list[str] = []

        def put(item, records):
            if item[0] == "m":
                early.extend(e.event_id for e in item[-1] if e.event_id not in committed)
            return real_put(item, records)

        journal.append = append
        telemetry.exporter.put = put
        service.retry_s = 0  # the failed commit is the caller's, not asked again
        m = make_manifest(request_id="a")
        service.execute(c.Allocate(handle_id="a", manifest=m, reserved_capacity=8))
        fail_next["on"] = True
        with pytest.raises(KvLedgerError):  # the commit failed: nothing may be claimed
            service.execute(c.Allocate(handle_id="b", manifest=make_manifest(request_id="b"),
                                       reserved_capacity=8))
        s = service.state("a")
        # a stale base and a conflicting retry are refused: outcome records, no journal event
        with pytest.raises(KvLedgerError):
            service.execute(c.BeginAppend(handle_id="a", txn_id="t", kind="prefill", base_generation=0,
                                          base_snapshot_version=5, interval_start=0, interval_count=4,
                                          token_ids=(11, 22, 33, 44), cache_positions=(0, 1, 2, 3),
                                          mask_key_extent=4, cache_abi_sha256=s.cache_abi_sha256))
        with pytest.raises(KvLedgerError):
            service.execute(c.Allocate(handle_id="a", manifest=m, reserved_capacity=9, operation_id="x"))
        service.execute(c.CancelRequest(handle_id="a", base_generation=0))
        service.execute(c.Release(handle_id="a", base_generation=0))
        telemetry.close()
        rec = reconcile(journal_events(journal), jsonl_bodies(path), telemetry.metrics.scrape().decode())
    assert early == []
    records = [r for r in _records(path) if isinstance(r, Mutation)]
    assert all(r.request_id != "b" for r in records)  # the failed commit left no claim
    refused = [r for r in records if r.outcome == "refused"]
    assert [(r.event_type, r.code) for r in refused] == [("append_start", "STALE_BASE"),
                                                         ("request_allocate", "HANDLE_EXISTS")]
    assert rec.findings == [] and rec.summary.refused == 2 and rec.summary.paired == 3
    scrape = telemetry.metrics.scrape()
    assert _scalar(scrape, "kvledger_command_rejections_total", code="STALE_BASE") == 1
    assert _scalar(scrape, "kvledger_append_outcomes_total", outcome="stale") == 1


# -- export never blocks; drops are counted and reconcile reports exactly those ----------

class KillableSink:
    """A binary sink that fails every write once killed (a dead collector)."""

    def __init__(self, path: Path) -> None:
        self.f = open(path, "wb")
        self.killed = threading.Event()

    def write(self, data: bytes) -> int:
        if self.killed.is_set():
            raise OSError(errno.EPIPE, "telemetry collector is gone")
        return self.f.write(data)

    def flush(self) -> None:
        if self.killed.is_set():
            raise OSError(errno.EPIPE, "telemetry collector is gone")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def test_killed_sink_loses_only_counted_records(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    init_database(url)
    path = tmp_path / "t.jsonl"
    sink = KillableSink(path)
    telemetry = Telemetry(sink)

    at_kill: list[int] = []

    def kill(worker) -> None:
        # The sink dies mid-run, once the exporter has written all it was given: no
        # producer runs between steps, so every record before this point is written and
        # every later one is lost. (A fixed sleep here once let the run race the kill.)
        if worker.step_no == 4:
            x = telemetry.exporter
            deadline = time.monotonic() + 10
            while (x._out < x._in or x._pending) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert x._out == x._in and not x._pending, "the exporter did not drain within 10 s"
            at_kill.append(telemetry.emitted)
            sink.killed.set()

    with open_or_create_journal(url) as journal:
        result = run_demo(journal, DemoOptions(requests=6, max_new_tokens=4, seed=2), telemetry=telemetry, on_step=kill)
        telemetry.close()
        sink.close()
        assert result["errors"] == []
        events = list(journal_events(journal))
        assert verify_journal(journal).ok
        heads = journal.heads()
    # the journal is complete: every request (and the fork child) ran to its release
    assert len(heads) == result["handles"] == 7 and all(h.lifecycle == "RELEASED" for h in heads.values())
    assert sum(1 for e in events if e.event_type == "output_emit") >= 6 * 4
    written = _records(path)
    stats = telemetry.stats()
    assert at_kill and 0 < at_kill[0] < telemetry.emitted  # records on both sides of the kill
    assert stats["written"] == at_kill[0] and stats["dropped_sink_error"] == telemetry.dropped
    assert telemetry.dropped == telemetry.emitted - at_kill[0]
    assert stats["written"] + telemetry.dropped == telemetry.emitted
    assert not any(getattr(r, "record", None) == "trailer" for r in written)
    rec = reconcile(iter(events), jsonl_bodies(path))
    assert {f.code for f in rec.findings} == {"LOST_AUDIT"}
    assert len(rec.findings) == telemetry.dropped
    # what was lost is exactly the tail after the sink died
    seen = {r.event_id for r in written if isinstance(r, Mutation)}
    last = max(e.global_position for e in events if e.event_id in seen)
    lost = {f.event_ids[0] for f in rec.findings if f.source.endswith("/command_service")}
    assert lost == {e.event_id for e in events if e.global_position > last}
    scrape = telemetry.metrics.scrape()
    assert _scalar(scrape, "kvledger_telemetry_dropped_records_total", reason="sink_error") == telemetry.dropped


def test_batches_are_rendered_by_the_producer_and_a_partial_one_is_written_when_traffic_stops(tmp_path):
    """A full batch is rendered on the committing thread and queued at once; what is
    left of a batch when traffic stops reaches the sink within about `linger`, without
    waiting for close."""
    with _traced_service(tmp_path) as (journal, service, telemetry, path):
        x = telemetry.exporter
        x.batch = 4
        rendered_on: set[str] = set()
        real = x._render_lines
        x._render_lines = lambda batch: (rendered_on.add(threading.current_thread().name), real(batch))[1]
        _drive(service, 0, 3, batch=1)  # 3 commits of 6 operations: with the header, 19 items
        assert threading.current_thread().name in rendered_on
        deadline = time.monotonic() + 5
        while len(_records(path, live=True)) < 1 + 18 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(_records(path)) == 1 + 18  # the header and every record, before close
        assert "kvledger-telemetry" in rendered_on  # the partial batch: the writer rendered it
        telemetry.close()
        assert len(_records(path)) == 1 + 18 + 1  # the trailer
        rec = reconcile(journal_events(journal), jsonl_bodies(path))
    assert rec.findings == [] and telemetry.dropped == 0


def test_stopping_while_the_writer_renders_an_idle_batch_loses_nothing(tmp_path):
    """The writer thread renders what producers leave when it idles; a stop in that
    moment once left the rendered batch queued behind the stop mark, unwritten: the
    run's last records and its trailer, ~1 stop in 60 here (a mid-run scrape's
    reconcile then named LOST_AUDIT). A linger of a microsecond and a thread switch at
    every chance open that moment on most stops."""
    header = Header(schema_version=1, source_instance="app", components=("command_service",))
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for i in range(400):
            path = tmp_path / f"{i}.jsonl"
            x = Exporter(path, capacity=16, metrics=Metrics(), linger=1e-6)
            x.put(("h", header), 0)
            x.put(("t", "app", 0, 0, 0), 0)
            x.stop(10)
            assert len(path.read_bytes().splitlines()) == 2, f"stop {i}: {path.read_bytes()!r}"
    finally:
        sys.setswitchinterval(switch)


def test_a_batch_that_cannot_be_encoded_is_dropped_and_counted_not_raised(tmp_path):
    """Rendering runs inside the service's hook: an encoder failure must neither reach
    the service nor lose count; the records are dropped and reconcile says so."""
    with _traced_service(tmp_path) as (journal, service, telemetry, path):
        x = telemetry.exporter
        x.batch = 4
        real = x._log.msg
        calls = Count()

        def msg(**kw):
            calls["msg"] += 1
            if calls["msg"] == 2:  # the batch after the header's
                raise TypeError("cannot encode")
            return real(**kw)

        x._log.msg = msg
        _drive(service, 0, 2, batch=1)  # every command committed: no exception escaped
        telemetry.close()
        rec = reconcile(journal_events(journal), jsonl_bodies(path))
        n_events = journal.last_position()
    stats = telemetry.stats()
    assert stats["dropped_sink_error"] == telemetry.dropped > 0 and "cannot encode" in stats["sink_error"]
    assert stats["written"] + telemetry.dropped == telemetry.emitted == n_events
    # the lost batch is a hole in local_sequence: reconcile names each lost record and the gap
    lost = [f for f in rec.findings if f.code == "LOST_AUDIT"]
    assert len(lost) == telemetry.dropped and {f.code for f in rec.findings} == {"LOST_AUDIT", "SEQUENCE_GAP"}


class SlowSink:
    def __init__(self, path: Path) -> None:
        self.f = open(path, "wb")

    def write(self, data: bytes) -> int:
        time.sleep(0.03)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _drive(service: CommandService, start: int, n: int, batch: int = 10, prefix: str = "r") -> None:
    """n tiny requests (allocate, prefill, publish, emit, finish, release), `batch`
    requests per journal commit, through the command service: no model needed."""
    for lo in range(start, start + n, batch):
        cmds = []
        for i in range(lo, min(lo + batch, start + n)):
            h = f"{prefix}{i}"
            cmds.append(c.Allocate(handle_id=h, manifest=make_manifest(request_id=h), reserved_capacity=8))
            cmds += [c.Relative(x) for x in (
                c.BeginAppend(handle_id=h, txn_id=f"t{h}", kind="prefill", base_generation=None,
                              base_snapshot_version=None, interval_start=0, interval_count=4,
                              token_ids=(11, 22, 33, 44), cache_positions=(0, 1, 2, 3), mask_key_extent=4,
                              cache_abi_sha256=""),
                c.Publish(handle_id=h, txn_id=f"t{h}", base_generation=None, base_snapshot_version=None),
                c.EmitOutput(handle_id=h, base_generation=None, base_snapshot_version=None, output_index=0,
                             token_id=7),
                c.Finish(handle_id=h, base_generation=None),
                c.Release(handle_id=h, base_generation=None))]
        results = service.execute_many(cmds)
        assert not any(isinstance(r, Exception) for r in results), results


def test_full_queue_drops_are_counted_and_reported_as_lost_audit(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    init_database(url)
    path = tmp_path / "t.jsonl"
    with open_or_create_journal(url) as journal:
        service = CommandService(journal)
        telemetry = Telemetry(SlowSink(path), queue_size=16).attach(service)
        # bursts faster than the sink: drops (below) prove the service never waited for it
        _drive(service, 0, 30, batch=3)
        time.sleep(0.5)  # the exporter catches up; the next burst is accepted again
        _drive(service, 30, 30, batch=3)
        telemetry.close()
        rec = reconcile(journal_events(journal), jsonl_bodies(path))
        n_events = journal.last_position()
    stats = telemetry.stats()
    assert stats["dropped_queue_full"] == telemetry.dropped > 0
    assert stats["written"] + telemetry.dropped == telemetry.emitted == n_events
    lost = [f for f in rec.findings if f.code == "LOST_AUDIT"]
    assert len(lost) == telemetry.dropped
    assert {f.finding_class for f in rec.findings} == {"lost_audit"}
    gaps = [f for f in rec.findings if f.code == "SEQUENCE_GAP"]
    assert gaps and sum(f.count for f in gaps) <= telemetry.dropped


# -- bounded metric labels ----------------------------------------------------------------

def test_metric_series_do_not_grow_with_traffic(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    init_database(url)
    with open_or_create_journal(url) as journal:
        service = CommandService(journal)
        telemetry = Telemetry(tmp_path / "t.jsonl").attach(service)
        port = telemetry.serve(0)
        _drive(service, 0, 100, batch=25)
        with pytest.raises(KvLedgerError):  # a refusal is a bounded code label too
            service.execute(c.Release(handle_id="r0", base_generation=0))
        after_100 = telemetry.metrics.scrape()
        _drive(service, 100, 900, batch=25)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            after_1000 = resp.read()
        telemetry.close()
    assert _scalar(after_1000, "kvledger_journal_events_total", event_type="request_allocate") == 1000
    assert _scalar(after_1000, "kvledger_append_outcomes_total", outcome="success") == 1000
    assert _scalar(after_1000, "kvledger_time_to_first_token_seconds_count") == 1000
    assert _series_per_family(after_100) == _series_per_family(after_1000)
    families = list(text_string_to_metric_families(after_1000.decode()))
    ours = [f for f in families if f.name.startswith("kvledger_")]
    assert len(ours) >= 11
    series = sum(len(f.samples) for f in ours)
    assert series < 300  # a fixed set, created up front: independent of the 1,000 requests
    ids = {f"r{i}" for i in range(1000)}
    for f in ours:
        for s in f.samples:
            assert not set(s.labels) & IDENTITY_LABELS, (f.name, s.labels)
            assert not set(s.labels.values()) & ids, (f.name, s.labels)


# -- the demo command line ------------------------------------------------------------------

@pytest.mark.parametrize("writer", ["thread", "process"])
def test_demo_cli_writes_telemetry_that_reconciles(tmp_path, capsys, writer):
    """Also with the service in a writer process: its receipts, events and refusals come
    back to the worker's process, where the telemetry hooks see them as they would here."""
    db = f"sqlite:///{tmp_path}/cli.db"
    tel, scrape = tmp_path / "t.jsonl", tmp_path / "m.txt"
    threads = torch.get_num_threads()
    try:
        rc = main(["demo", "--db", db, "--requests", "4", "--max-new-tokens", "3", "--json", "--writer", writer,
                   "--telemetry", str(tel), "--metrics-port", "0", "--metrics-out", str(scrape)])
    finally:
        use_threads(threads)  # --writer process leaves a core (and the I/O CPU) to its writer
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["telemetry"]["dropped"] == 0 and out["telemetry"]["written"] > 0
    assert out["telemetry"]["metrics_port"] > 0
    ran = out["writer"]
    assert ran["kind"] == writer and ran["torch_threads"] == (
        max(1, min(threads, tuning.usable_cpus() - 1)) if writer == "process" else threads)
    if ran["io_cpu"] is not None:  # placed: the model's thread kept off the writer's CPU
        assert writer == "process" and ran["io_cpu"] not in ran["model_cpus"]
    assert b"kvledger_telemetry_dropped_records_total" in scrape.read_bytes()
    rc = main(["reconcile", "--telemetry", str(tel), "--metrics", str(scrape), "--db", db, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["ok"] and doc["findings"] == []
    assert doc["summary"]["paired"] == out["events_written"]


def test_sampled_stream_keeps_whole_traces_and_proves_no_absence(tmp_path):
    url = f"sqlite:///{tmp_path}/j.db"
    init_database(url)
    path = tmp_path / "t.jsonl"
    with open_or_create_journal(url) as journal:
        service = CommandService(journal)
        telemetry = Telemetry(path, sample_rate=0.5).attach(service)
        _drive(service, 0, 40)
        telemetry.close()
        _drive(service, 40, 10, prefix="late")  # after the trailer: outside the file's scope
        events = list(journal_events(journal))
    records = [r for r in _records(path) if isinstance(r, Mutation)]
    per_request = Count(r.request_id for r in records)
    assert 0 < len(per_request) < 40
    assert set(per_request.values()) == {6}  # a request is kept whole or not at all
    assert [r.local_sequence for r in records] == list(range(1, len(records) + 1))
    rec = reconcile(iter(events), jsonl_bodies(path))
    assert [f.code for f in rec.findings] == ["SAMPLED_NO_ABSENCE"] and rec.ok
    assert rec.findings[0].count == 6 * (40 - len(per_request))
    assert rec.summary.in_scope == 6 * 40 < len(events)
    # metrics are never sampled
    assert _scalar(telemetry.metrics.scrape(), "kvledger_journal_events_total", event_type="finish") == 40


@pytest.mark.parametrize("kwargs, says", [
    ({"sample_rate": 0.0}, "sample_rate 0.0 not in (0, 1]"),
    ({"sample_rate": 1.5}, "sample_rate 1.5 not in (0, 1]"),
    ({"queue_size": 0}, "queue_size and block_size must be >= 1"),
    ({"block_size": 0}, "queue_size and block_size must be >= 1"),
])
def test_a_telemetry_source_of_no_capacity_or_rate_is_refused(tmp_path, kwargs, says):
    from kvledger.telemetry.producer import Telemetry

    with pytest.raises(KvLedgerError) as info:
        Telemetry(tmp_path / "t.jsonl", **kwargs)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and says in info.value.message
    assert not (tmp_path / "t.jsonl").exists()
