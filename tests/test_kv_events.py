"""kvledger kv-events record against the reference publisher (tests/kv_publisher.py):
2,000 batches of random stores and removes in each case, the journal holding every
published seq exactly once with the published events (issue 21). Each case runs in both
encodings: vLLM's (tagged maps, [topic, seq, payload]) and SGLang's (positional arrays,
[seq, payload])."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any

import msgspec
import pytest

pytest.importorskip("zmq")

from kvledger.journal import open_journal
from kvledger.schemas import events as ev

from kv_publisher import Publisher, Workload, model_resident, normalized
from kv_recording import (
    check_exactly_once,
    free_port,
    new_db,
    publish_batches,
    record_cli,
    recording,
    stream_events,
    verify_clean,
    wait_for,
)

N = 2000


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_dropped_batches_are_replayed_and_journaled_once(tmp_path, dialect):
    url = new_db(tmp_path)
    published: dict[tuple[int, int], list[Any]] = {}
    drop = set(range(100, N, 37)) | set(range(500, 540))
    with recording(url, dialect) as (pub, out):
        publish_batches(pub, Workload(1), N, published, drop=drop)
        got = wait_for(url, N)
    check_exactly_once(got, published)
    assert not [e for e in got if not isinstance(e, ev.KvEventsBatchEvent)], "no gap, no restart"
    s = out["summary"]
    assert s.replayed >= len(drop) and s.gaps == 0 and s.restarts == 0
    replayed = {e.payload.seq for e in got if e.payload.replayed}
    assert drop <= replayed


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_publisher_restart_is_journaled_and_clears_the_pool(tmp_path, dialect):
    from kvledger.replay import replay_journal
    from kvledger.replay.metrics import WindowSpec

    url = new_db(tmp_path)
    published: dict[tuple[int, int], list[Any]] = {}
    with recording(url, dialect) as (pub, _):
        publish_batches(pub, Workload(2, clears=False), N // 2, published)
        wait_for(url, N // 2)
        pub.restart()
        publish_batches(pub, Workload(3, clears=False), N // 2, published)
        got = wait_for(url, N)
    check_exactly_once(got, published)
    verify_clean(url)
    restarts = [e for e in got if isinstance(e, ev.KvEventsRestartEvent)]
    assert len(restarts) == 1
    r = restarts[0].payload
    assert (r.epoch, r.previous_seq, r.first_seq) == (1, N // 2 - 1, 0)
    # At the restart the stream's pool is empty; at the end it holds only epoch 1's blocks.
    with open_journal(url) as j:
        window = WindowSpec(slo_ttft_ns=1, slo_tbt_ns=1)
        at_restart = replay_journal(j, window, at=restarts[0].global_position)
        end = replay_journal(j, window)
    assert at_restart.kv_blocks is not None
    assert all(p.resident_blocks == 0 for p in at_restart.kv_blocks[0].pools.values())
    model = model_resident([published[(1, s)] for s in range(N // 2)])
    assert end.kv_blocks is not None
    assert {k.split("/")[0]: p.resident_blocks for k, p in end.kv_blocks[0].pools.items() if p.resident_blocks} \
        == {m: len(s) for m, s in model.items()}


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_evicted_batches_are_one_gap_with_the_exact_range(tmp_path, dialect):
    url = new_db(tmp_path)
    published: dict[tuple[int, int], list[Any]] = {}
    lost = set(range(700, 1100))  # 400 not sent live; the ring keeps only the last 200
    with recording(url, dialect, buffer_steps=200) as (pub, _):
        publish_batches(pub, Workload(4), N, published, drop=lost, pace=N)  # no pause: the ring moves on at once
        got = wait_for(url, 0, timeout=30, last=(0, N - 1))
        replays = list(pub.replays)
    gaps = [e.payload for e in got if isinstance(e, ev.KvEventsGapEvent)]
    assert len(gaps) == 1
    g = gaps[0]
    # The replay asked from 700 got what the ring still had: from its first seq on.
    served = [first for start, first in replays if start == 700]
    assert served and served[0] is not None
    end = min(served[0], max(lost) + 1)  # or the first live batch after the drop, if the ring moved past it
    assert (g.epoch, g.first_seq, g.last_seq) == (0, 700, end - 1)
    check_exactly_once(got, published, missing={(0, s) for s in range(700, end)})
    verify_clean(url)


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_sigkill_mid_run_then_restart_catches_up_by_replay(tmp_path, dialect):
    url = new_db(tmp_path)
    pub = Publisher(dialect)
    published: dict[tuple[int, int], list[Any]] = {}
    w = Workload(5)
    try:
        rec = record_cli(url, pub)
        time.sleep(1.5)  # the CLI starts and connects
        publish_batches(pub, w, 800, published, pace=50)
        mid = wait_for(url, 300)
        rec.send_signal(signal.SIGKILL)
        rec.wait(10)
        before = {(e.payload.epoch, e.payload.seq) for e in mid if isinstance(e, ev.KvEventsBatchEvent)}
        assert 0 < len(before)
        publish_batches(pub, w, 700, published)  # published while no recorder runs: only the ring has them
        rec = record_cli(url, pub, "--idle-exit", "2", "--block-bytes", "1024")
        time.sleep(1.5)
        publish_batches(pub, w, N - 1500, published, pace=50)
        out, err = rec.communicate(timeout=120)
    finally:
        pub.close()
    assert rec.returncode == 0, err.decode()
    got = stream_events(url)
    check_exactly_once(got, published)
    summary = msgspec.json.decode(out.splitlines()[-1])
    assert summary["replayed"] >= 700 and summary["gaps"] == 0 and summary["restarts"] == 0
    model = model_resident([published[(0, s)] for s in range(N)])
    assert list(summary["resident_bytes"].values()) == [1024 * sum(len(b) for b in model.values())]


def test_block_pool_projection_matches_an_independent_model_at_20_positions(tmp_path, capsys):
    import random

    from kvledger.cli import main
    from kvledger.replay.kv_blocks import resident
    from kvledger.replay.run import project
    from kvledger.replay.sources import journal_events

    url = new_db(tmp_path)
    published: dict[tuple[int, int], list[Any]] = {}
    with recording(url, "sglang") as (pub, _):
        publish_batches(pub, Workload(6), N, published, drop=set(range(50, N, 101)))
        got = wait_for(url, N)
    check_exactly_once(got, published)
    verify_clean(url)
    rng = random.Random(21)
    positions = sorted(rng.sample([e.global_position for e in got], 20))
    seq_at = {e.global_position: e.payload.seq for e in got}
    with open_journal(url) as j:
        for pos in positions:
            state = project(journal_events(j, 0, pos)).kv.state
            (sid,) = state.streams
            blocks = {k.split("/")[0]: set(v) for k, v in resident(state, sid).items()}
            assert blocks == model_resident([published[(0, s)] for s in range(seq_at[pos] + 1)]), pos
    # The CLI's --at and --block-bytes over the same fold.
    capsys.readouterr()
    pos = positions[7]
    assert main(["replay", "--db", url, "--at", str(pos), "--json", "--block-bytes", "4096"]) == 0
    doc = msgspec.json.decode(capsys.readouterr().out)
    model = model_resident([published[(0, s)] for s in range(seq_at[pos] + 1)])
    pools = doc["kv_blocks"][0]["pools"]
    assert {k.split("/")[0]: p["resident_blocks"] for k, p in pools.items() if p["resident_blocks"]} \
        == {m: len(s) for m, s in model.items()}
    assert all(p["resident_bytes"] == 4096 * p["resident_blocks"] for p in pools.values())
    assert doc["kv_blocks"][0]["seq"] == seq_at[pos]


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_the_recorder_journals_the_same_bytes_from_either_form_of_a_batch(dialect):
    """The live recorder hands the Recorder each batch's events already as JSON
    (decode_batch_encoded); the journal's bytes are those of the kv events themselves,
    through held batches, a gap and a restart too (each recording's clocks and source
    name its own)."""
    from kvledger.adapters.kv_events_recorder import Recorder
    from kvledger.adapters.kv_events_wire import decode_batch, decode_batch_encoded
    from kvledger.schemas.codec import encode_event

    from kv_publisher import encode

    w = Workload(11)
    first = [(i, encode(dialect, 1.0 + i, w.batch(), 0)) for i in [*range(10), 12, *range(13, 20), *range(25, 30)]]
    restarted = [(i, encode(dialect, 50.0 + i, w.batch(), 0)) for i in range(8)]  # new bytes at old seqs
    bodies, summaries = [], []
    for decode in (decode_batch, decode_batch_encoded):
        rec = Recorder("tcp://127.0.0.1:1", "kv", {}, replayable=False)
        for seq, payload in first + restarted:
            rec.message(seq, payload, decode(payload), replayed=False)
        bodies.append([encode_event(msgspec.structs.replace(e, global_position=i + 1, monotonic_ns=0,
                                                            observed_wall_time=0, source_instance="-"))
                       for i, e in enumerate(e for op in rec.take() for wr in op.writes for e in wr.events)])
        summaries.append(rec.summary)
    assert bodies[0] == bodies[1] and summaries[0] == summaries[1]
    assert (summaries[1].batches, summaries[1].events, summaries[1].gaps, summaries[1].restarts) == (31, 310, 2, 1)


def test_verify_finds_a_missing_and_a_repeated_seq():
    from kvledger.adapters.kv_events_recorder import Recorder
    from kvledger.adapters.kv_events_wire import decode_batch
    from kvledger.replay.verify import KV_SEQ_ORDER, verify_bodies
    from kvledger.schemas.codec import encode_event

    from kv_publisher import encode

    rec = Recorder("tcp://127.0.0.1:1", "kv", {}, replayable=False)
    w = Workload(7)
    for seq in range(6):
        payload = encode("vllm", 1.0 + seq, w.batch(), 0)
        rec.message(seq, payload, decode_batch(payload), replayed=False)
    events = [e for op in rec.take() for write in op.writes for e in write.events]

    def bodies(evs: list[Any]) -> list[tuple[int, bytes]]:
        return [(i + 1, encode_event(msgspec.structs.replace(e, global_position=i + 1, stream_position=i + 1)))
                for i, e in enumerate(evs)]

    assert verify_bodies(bodies(events)).ok
    missing = verify_bodies(bodies(events[:3] + events[4:]))
    assert [f.code for f in missing.findings] == [KV_SEQ_ORDER]
    assert "seq 4" in missing.findings[0].message and "no gap journaled" in missing.findings[0].message
    # seq 3 twice (as another event): the repeat is found, and the stream goes on after it
    again = msgspec.structs.replace(events[3], event_id="again")
    repeated = verify_bodies(bodies(events[:4] + [again] + events[4:]))
    assert [f.code for f in repeated.findings] == [KV_SEQ_ORDER]
    assert "seq 3" in repeated.findings[0].message and "again" in repeated.findings[0].message


def test_a_recorded_journal_exports_imports_and_verifies(tmp_path, db_url):
    """Recorded on each backend; export, import into a new journal (heads and receipts
    derived from the events), verify clean: the KV-event streams' head rows are derived
    like the recorder's."""
    from kvledger.cli import main

    url = db_url
    published: dict[tuple[int, int], list[Any]] = {}
    with recording(url, "vllm", buffer_steps=50) as (pub, _):
        publish_batches(pub, Workload(8), 300, published, drop=set(range(100, 200)), pace=300)
        wait_for(url, 0, timeout=30, last=(0, 299))
        pub.restart()
        publish_batches(pub, Workload(9), 50, published)
        wait_for(url, 0, timeout=30, last=(1, 49))
    out = tmp_path / "kv.jsonl"
    assert main(["export", "--db", url, "--out", str(out)]) == 0
    copy = f"sqlite:///{tmp_path / 'copy.db'}"
    assert main(["import", "--db", copy, str(out)]) == 0
    verify_clean(copy)
    with open_journal(url) as a, open_journal(copy) as b:
        assert a.heads() == b.heads()
        kinds = {e.event_type for e in a.read_all()}
    assert kinds == {"kv_events_batch", "kv_events_gap", "kv_events_restart"}


def _client_apply(pools: dict[str, set[Any]], events: list[dict[str, Any]]) -> None:
    """What a router does with replayed events (vLLM names, default pool `-` group)."""
    for e in events:
        key = f"{e.get('medium', '-')}/{e.get('group_idx', '-')}"
        if e["type"] == "BlockStored":
            pools.setdefault(key, set()).update(e["block_hashes"])
        elif e["type"] == "BlockRemoved":
            pools.setdefault(key, set()).difference_update(e["block_hashes"])
        else:
            pools.clear()


def test_serve_replays_any_seq_and_a_snapshot_plus_replay_rebuilds_the_block_set(tmp_path):
    """A DEALER gets exactly the recorded batches from any start seq, then the end
    marker; a snapshot taken mid-run plus a replay from its seq == a full replay's
    block set."""
    import zmq

    from kvledger.adapters.kv_events_wire import decode_batch
    from kvledger.replay.kv_blocks import resident
    from kvledger.replay.run import project
    from kvledger.replay.sources import journal_events

    url = new_db(tmp_path)
    published: dict[tuple[int, int], list[Any]] = {}
    bind = f"tcp://127.0.0.1:{free_port()}"
    server = subprocess.Popen([sys.executable, "-m", "kvledger", "kv-events", "serve", "--bind", bind, "--db", url],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(bind)

    def request(*frames: bytes) -> list[bytes]:
        dealer.send_multipart([b"", *frames])
        assert dealer.poll(20_000), "no reply"
        return dealer.recv_multipart()

    def replay(start: int) -> list[tuple[int, list[Any]]]:
        out = []
        frames = request(start.to_bytes(8, "big"))
        while frames != [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]:  # vLLM 0.33's end marker
            empty, topic, seq, payload = frames
            assert (empty, topic) == (b"", b"kv")
            _, events, rank = decode_batch(payload)
            assert rank == 0
            out.append((int.from_bytes(seq, "big"), msgspec.json.decode(msgspec.json.encode(events))))
            assert dealer.poll(20_000), "no end marker"
            frames = dealer.recv_multipart()
        return out

    try:
        with recording(url, "vllm") as (pub, _):
            w = Workload(10)
            publish_batches(pub, w, N // 2, published)
            wait_for(url, N // 2)
            _, tag, body = request(b"SNAPSHOT", b"")
            snap = msgspec.json.decode(body)
            publish_batches(pub, w, N // 2, published)
            got = wait_for(url, N)
        for start in (0, 1, 777, 1999, 2000, 5000):
            got_back = replay(start)
            assert [s for s, _ in got_back] == list(range(start, N))
            assert all(events == normalized(published[(0, s)]) for s, events in got_back)
        tail = replay(snap["next_seq"])
        assert request(b"SNAPSHOT", b"no such stream")[1] == b"ERROR"
    finally:
        dealer.close(0)
        ctx.term()
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=30)
    assert server.returncode == 0, err.decode()
    check_exactly_once(got, published)
    assert tag == b"SNAPSHOT" and snap["seq"] + 1 == snap["next_seq"] >= N // 2
    with open_journal(url) as j:
        full = project(journal_events(j)).kv.state
    (sid,) = full.streams
    assert snap["stream_id"] == sid
    pools = {k: set(v) for k, v in snap["pools"].items()}
    assert tail and tail[0][0] == snap["next_seq"]
    for _, events in tail:
        _client_apply(pools, events)
    assert {k: v for k, v in pools.items() if v} == {k: set(v) for k, v in resident(full, sid).items()}


def test_a_recorder_resuming_a_stream_after_a_reboot_is_another_source(tmp_path, monkeypatch):
    """A monotonic clock is its process's, never compared across processes (spec). A
    recording that resumes a stream after its host rebooted (the clock starting again near
    zero) stamps its own source_instance: verify finds no TIME_REGRESSION between the two."""
    import kvledger.adapters.kv_events_recorder as recorder
    from kvledger.adapters.kv_events_wire import decode_batch

    from kv_publisher import encode

    url = new_db(tmp_path)
    w = Workload(3)
    batches = [(i, encode("vllm", 1.0 + i, w.batch(), 0)) for i in range(20)]
    with open_journal(url) as j:
        for part, booted_ns in ((batches[:10], 9 * 10**14), (batches[10:], 10**9)):  # then a reboot
            with monkeypatch.context() as m:
                m.setattr(recorder.time, "monotonic_ns", iter(range(booted_ns, booted_ns + 10**6)).__next__)
                rec = recorder.Recorder("tcp://127.0.0.1:1", "kv", j.heads(), replayable=False)
                for seq, payload in part:
                    rec.message(seq, payload, decode_batch(payload), replayed=False)
                ops = rec.take()
            j.append(ops)
        got = [e for e in j.read_all() if isinstance(e, ev.KvEventsBatchEvent)]
    assert [e.payload.seq for e in got] == list(range(20))
    first, second = {e.source_instance for e in got[:10]}, {e.source_instance for e in got[10:]}
    assert len(first) == len(second) == 1 and first != second
    assert all(x.startswith(recorder.SOURCE + "-") for x in first | second)
    verify_clean(url)
