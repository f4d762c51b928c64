"""kvledger kv-events record against hostile or careless publishers (issue 44): it never
loses what it received, never poisons the journal, and stays bounded.

- exit (SIGTERM, --idle-exit) while batches wait for a replay that never answers;
- a wire-valid batch too large for the journal: a coded refusal of its seq;
- held batches capped in bytes; receive queues capped (a seq hole, replayed);
- seqs outside 0..2^63-2: skipped, counted, the recorder goes on;
- a wrong --topic: exit 1 and the topics seen.
"""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip("zmq")

from kvledger.adapters.kv_events_recorder import (
    ENVELOPE_BYTES,
    HELD_OVERHEAD,
    RETRIES,
    STOPPED,
    Recorder,
    stream_id,
)
from kvledger.adapters.kv_events_wire import MAX_SEQ, decode_batch_encoded
from kvledger.journal.contract import HeadFacts
from kvledger.schemas import events as ev
from kvledger.schemas import kv_events as kv
from kvledger.schemas.codec import MAX_EVENT_BYTES, encode_event
from kvledger.schemas.errors import ErrorCode

from kv_publisher import Publisher, Workload, encode
from kv_recording import (
    check_exactly_once,
    new_db,
    publish_batches,
    record_cli,
    recording,
    stream_events,
    verify_clean,
    wait_for,
)


def _connected(pub: Publisher, timeout: float = 60) -> None:
    """The recorder process has started: its replay request (sent at start, after its SUB
    connects) came in."""
    deadline = time.monotonic() + timeout
    while not pub.requests:
        assert time.monotonic() < deadline, "the recorder did not start"
        time.sleep(0.05)
    time.sleep(0.3)  # its subscription reaches the PUB


def _summary(out: bytes) -> dict[str, Any]:
    return msgspec.json.decode(out.splitlines()[-1])


# -- 1. exit while holding batches ----------------------------------------------------

@pytest.mark.parametrize("how", ["sigterm", "idle-exit"])
def test_exit_while_a_replay_never_answers_journals_the_held_batches_and_the_gap(tmp_path, how):
    """Seqs 10-14 are lost, 15-29 arrive and wait for a replay the publisher never sends:
    at exit 10-14 are a gap that says the recorder stopped, and 15-29 are journaled."""
    url = new_db(tmp_path)
    pub = Publisher("vllm", answer_replays=False)
    published: dict[tuple[int, int], list[Any]] = {}
    w = Workload(41)
    try:
        rec = record_cli(url, pub, *(["--idle-exit", "1.5"] if how == "idle-exit" else []))
        _connected(pub)
        publish_batches(pub, w, 10, published)
        wait_for(url, 10, timeout=30)
        publish_batches(pub, w, 20, published, drop=set(range(0, 5)))  # seqs 10-14 never sent live
        if how == "sigterm":
            time.sleep(1.0)  # 15-29 are received and held
            rec.send_signal(signal.SIGTERM)
        out, err = rec.communicate(timeout=60)
    finally:
        pub.close()
    assert rec.returncode == 0, err.decode()
    got = stream_events(url)
    gaps = [e.payload for e in got if isinstance(e, ev.KvEventsGapEvent)]
    assert [(g.first_seq, g.last_seq, g.reason) for g in gaps] == [(10, 14, STOPPED)]
    check_exactly_once(got, published, missing={(0, s) for s in range(10, 15)})
    verify_clean(url)
    s = _summary(out)
    assert (s["batches"], s["gaps"], s["gap_seqs"]) == (25, 1, 5)


def test_stop_journals_every_hole_below_a_held_batch():
    rec = Recorder("tcp://127.0.0.1:1", "kv", {}, replayable=True)
    w = Workload(42)
    for seq in (0, 1, 4, 5, 9):
        payload = encode("vllm", 1.0, w.batch(), 0)
        rec.message(seq, payload, decode_batch_encoded(payload), replayed=False)
    assert rec.summary.held_batches == 3
    rec.stop()
    events = [e for op in rec.take() for wr in op.writes for e in wr.events]
    assert [(e.payload.seq,) if isinstance(e, ev.KvEventsBatchEvent) else (e.payload.first_seq, e.payload.last_seq)
            for e in events] == [(0,), (1,), (2, 3), (4,), (5,), (6, 8), (9,)]
    assert (rec.summary.held_batches, rec.summary.held_bytes) == (0, 0)


# -- 2. a batch too large for the journal -----------------------------------------------

def _huge_events() -> list[tuple[str, dict[str, Any]]]:
    """One BlockStored of 140,000 hashes of 256 bytes: 36 MB of msgpack, 72 MB of JSON."""
    return [("BlockStored", {"block_hashes": [i.to_bytes(256, "big") for i in range(140_000)],
                             "parent_block_hash": None, "token_ids": [], "block_size": 0, "lora_id": None,
                             "medium": "GPU"})]


def test_a_batch_too_large_for_the_journal_is_a_coded_refusal_of_its_seq(tmp_path):
    """Sent live by a real publisher between two good batches: its seq is journaled as a
    gap with FIELD_TOO_LARGE and its size, the next batch follows, and the journal verifies,
    replays, exports and imports."""
    from kvledger.cli import main

    url = new_db(tmp_path)
    w = Workload(43)
    published: dict[tuple[int, int], list[Any]] = {}
    with recording(url, "vllm") as (pub, out):
        publish_batches(pub, w, 1, published)
        huge = _huge_events()
        pub.publish(huge)
        publish_batches(pub, w, 1, published)
        got = wait_for(url, 0, timeout=60, last=(0, 2))
    assert "error" not in out, out
    gaps = [e.payload for e in got if isinstance(e, ev.KvEventsGapEvent)]
    (_, fields), = huge
    size = len(msgspec.json.encode((kv.BlockStored(tuple(h.hex() for h in fields["block_hashes"]), medium="GPU"),)))
    assert len(gaps) == 1 and (gaps[0].first_seq, gaps[0].last_seq) == (1, 1)
    assert (gaps[0].code, gaps[0].size_bytes) == ("FIELD_TOO_LARGE", size) and size > MAX_EVENT_BYTES
    check_exactly_once(got, published)
    assert (out["summary"].too_large, out["summary"].batches) == (1, 2)
    verify_clean(url)
    assert main(["replay", "--db", url, "--json"]) == 0
    assert main(["export", "--db", url, "--out", str(tmp_path / "kv.jsonl")]) == 0
    assert main(["import", "--db", f"sqlite:///{tmp_path / 'copy.db'}", str(tmp_path / "kv.jsonl")]) == 0


def test_the_envelope_bound_holds_for_the_longest_names_and_numbers():
    """What a batch's envelope and payload fields add to its events' JSON stays under
    ENVELOPE_BYTES even for a stream id of escaped characters at its longest, the largest
    epoch, seq and position, and the longest float and rank."""
    endpoint = "ipc://" + "\x01" * (200 - len("kv:ipc://|" + "|dp-9223372036854775808"))
    rank = -(1 << 63)
    sid = stream_id(endpoint, "", rank)
    assert len(sid) == 200
    big = (1 << 63) - 2
    rec = Recorder(endpoint, "", {sid: HeadFacts(sid, big, MAX_SEQ, big, 0, "KV_EVENTS", "", "")},
                   replayable=False)
    payload = msgspec.msgpack.encode([-1.2345678901234567e-300, [], rank])
    rec.message(MAX_SEQ, payload, decode_batch_encoded(payload), replayed=False)
    (op,) = rec.take()
    (e,) = op.writes[0].events
    stored = encode_event(msgspec.structs.replace(e, global_position=(1 << 63) - 1, operation_id=op.operation_id
                                                  + "+255"))
    assert len(stored) - len(b"[]") < ENVELOPE_BYTES
    assert len(stored) > 2 * 200 * 6  # the escaped stream id is in it twice


# -- 3. memory bounded in bytes ----------------------------------------------------------

def test_held_batches_stay_under_the_byte_cap_and_the_cap_journals_the_oldest_hole(tmp_path):
    """A replay that never answers: past the cap the oldest hole becomes a gap and what
    follows it is journaled; the held bytes never pass the cap; the journal verifies."""
    from kvledger.migrations.storage import open_or_create_journal
    from kvledger.replay.verify import verify_journal

    w = Workload(44)
    payloads = [encode("vllm", 1.0, w.batch(), 0) for _ in range(400)]
    size = len(decode_batch_encoded(payloads[0])[1].json) + HELD_OVERHEAD
    cap = 20 * size
    rec = Recorder("tcp://127.0.0.1:1", "kv", {}, replayable=True, max_held_bytes=cap)
    lost = {1, 2, 50, 51, 52, 200}
    for seq, p in enumerate(payloads):
        if seq not in lost:
            rec.message(seq, p, decode_batch_encoded(p), replayed=False)
        assert rec.summary.held_bytes <= cap
    s = rec.summary
    assert s.cap_gaps == 3 and s.cap_gap_seqs == len(lost) and s.gaps == 3
    assert cap - size <= s.held_bytes_peak <= cap
    with open_or_create_journal(f"sqlite:///{tmp_path / 'kv.db'}") as j:
        j.append(rec.take())
        gaps = [(e.payload.first_seq, e.payload.last_seq) for e in j.read_all()
                if isinstance(e, ev.KvEventsGapEvent)]
        assert gaps == [(1, 2), (50, 52), (200, 200)]
        assert verify_journal(j).ok


def test_a_drain_of_held_batches_is_committed_in_parts_of_bounded_bytes():
    """A hole filled at last releases everything held at once: the loop takes it in parts
    of at most FLUSH_BYTES (plus one batch), so a commit never holds the whole cap again;
    the parts are the same operations as one take, and the summary comes with the last."""
    w = Workload(53)
    payloads = [encode("vllm", 1.0, w.batch(), 0) for _ in range(300)]
    decided = []
    for parts in (False, True):
        rec = Recorder("tcp://127.0.0.1:1", "kv", {}, replayable=True)
        for seq in range(1, 300):
            rec.message(seq, payloads[seq], decode_batch_encoded(payloads[seq]), replayed=False)
        rec.message(0, payloads[0], decode_batch_encoded(payloads[0]), replayed=True)
        assert rec.summary.batches == 300 and rec.ops_bytes > 100_000
        if not parts:
            decided.append(rec.take())
            continue
        one = len(decode_batch_encoded(payloads[0])[1].json)
        taken = []
        while rec.ops:
            t = rec.take_group(most_bytes=50_000)
            size = sum(len(e.payload.events) for op in t.ops for wr in op.writes for e in wr.events)
            assert size < 50_000 + 2 * one and (t.summary is None) == bool(rec.ops)
            taken.append(t)
        assert len(taken) > 3 and taken[-1].summary == rec.summary and rec.ops_bytes == 0
        decided.append([op for t in taken for op in t.ops])
    ids = [[e.event_id for op in ops for wr in op.writes for e in wr.events] for ops in decided]
    assert ids[0] == ids[1] and len(ids[0]) == 300


def test_a_flood_past_the_receive_hwm_shows_as_holes_that_are_replayed(tmp_path):
    """The journal is locked while the publisher floods: the recorder's queues fill (its
    decided batches, then its sockets' --rcvhwm), ZMQ pushes back, the publisher drops
    (SNDHWM 100). Once the lock goes, the next batches show the drops as a seq hole the
    replay fills: every batch journaled once. With no receive HWM the recorder would have
    taken all of it into its own memory, and dropped nothing."""
    url = new_db(tmp_path)
    published: dict[tuple[int, int], list[Any]] = {}
    n = 5_000
    with recording(url, "vllm", record={"rcvhwm": 50}, sndhwm=100, buffer_steps=n + 100) as (pub, out):
        w = Workload(45)
        publish_batches(pub, w, 10, published)
        wait_for(url, 10, timeout=30)
        lock = sqlite3.connect(str(tmp_path / "kv.db"), isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")
        try:
            for _ in range(n):
                events = w.batch(60)  # ~6 KB: the decided batches' FLUSH_BYTES fills at ~2,500
                published[(0, pub.publish(events))] = events
            time.sleep(1.0)
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        # A hole shows only below a later seq, and one sent while the publisher's queue is
        # still full is dropped too: one more every half second until all are journaled.
        deadline = time.monotonic() + 120
        while len(got := wait_for(url, len(published), timeout=0.5)) < len(published):
            assert time.monotonic() < deadline, "the recorder did not catch up"
            publish_batches(pub, w, 1, published)
    assert "error" not in out, out
    check_exactly_once(got, published)
    s = out["summary"]
    assert s.replayed > 0 and s.gaps == 0, s


@pytest.mark.parametrize("losses", [1, 4])
def test_a_batch_a_replay_sends_around_is_asked_again_before_it_is_a_gap(tmp_path, losses):
    """Seqs 100-149 are not sent live; the replay leaves 120 out `losses` times (as a
    ROUTER past its HWM drops a reply). It had 120 (it sent 100-119): asked again, and
    journaled when it comes; after RETRIES replays without it, a gap of 120 alone."""
    url = new_db(tmp_path)
    published: dict[tuple[int, int], list[Any]] = {}
    with recording(url, "vllm", replay_loses={120: losses}) as (pub, out):
        publish_batches(pub, Workload(54), 300, published, drop=set(range(100, 150)), pace=300)
        got = wait_for(url, 0, timeout=60, last=(0, 299))
        time.sleep(0.3)
    assert "error" not in out, out
    gaps = [(e.payload.first_seq, e.payload.last_seq) for e in got if isinstance(e, ev.KvEventsGapEvent)]
    assert gaps == ([] if losses <= RETRIES else [(120, 120)])
    check_exactly_once(got, published, missing=set() if losses <= RETRIES else {(0, 120)})
    verify_clean(url)


def test_the_replay_retry_is_decided_from_what_the_replay_sent():
    w = Workload(55)
    payloads = [encode("vllm", 1.0, w.batch(), 0) for _ in range(20)]

    def feed(rec: Recorder, seqs: range | list[int], replayed: bool) -> None:
        for seq in seqs:
            rec.message(seq, payloads[seq], decode_batch_encoded(payloads[seq]), replayed=replayed)

    # the replay sent 5-7 and 9-11 around the hole at 8: asked again from 8
    rec = Recorder("tcp://127.0.0.1:1", "kv", {}, replayable=True)
    rec.replay_sent()
    rec.replay_done()
    feed(rec, range(5), False)
    feed(rec, [12, 13], False)
    assert rec.replay_wanted == 5
    rec.replay_sent()
    feed(rec, [5, 6, 7, 9, 10, 11], True)
    rec.replay_done()
    assert (rec.replay_wanted, rec.summary.gaps) == (8, 0)
    # a replay that starts above the hole: the publisher no longer has it, a gap at once
    rec2 = Recorder("tcp://127.0.0.1:1", "kv", {}, replayable=True)
    rec2.replay_sent()
    rec2.replay_done()
    feed(rec2, [0, 4], False)
    rec2.replay_sent()
    feed(rec2, [3, 4], True)
    rec2.replay_done()
    assert (rec2.replay_wanted, rec2.summary.gaps, rec2.summary.gap_seqs) == (None, 1, 2)


# -- 4. seqs outside 0..2^63-2 ------------------------------------------------------------

@pytest.mark.parametrize("seq", [(1 << 63) - 1, -2, -(1 << 63)])
def test_a_seq_outside_the_journal_range_is_skipped_and_counted(tmp_path, seq):
    """A publisher sends one batch at `seq`, then the next five: the recorder says the skip
    on stderr with its code, counts it, journals the five and exits 0; so does a second
    run, which meets the same batch again (once: the three seqs take one path there)."""
    url = new_db(tmp_path)
    w = Workload(46)
    pub = Publisher("vllm", answer_replays=False)
    runs = 2 if seq == (1 << 63) - 1 else 1
    try:
        for _ in range(runs):
            rec = record_cli(url, pub, "--idle-exit", "1.5")
            _connected(pub)
            pub.send([b"kv", seq.to_bytes(8, "big", signed=True), encode("vllm", 1.0, w.batch(), 0)])
            publish_batches(pub, w, 5, {})
            out, err = rec.communicate(timeout=60)
            pub.requests = 0
            assert rec.returncode == 0, err.decode()
            lines = [ln for ln in err.decode().splitlines() if "skipped" in ln]
            assert len(lines) == 1 and "MALFORMED_EVENT" in lines[0] and str(seq) in lines[0], lines
            s = _summary(out)
            assert (s["skipped"], s["skipped_codes"], s["batches"]) == (1, {"MALFORMED_EVENT": 1}, 5)
    finally:
        pub.close()
    assert sorted(e.payload.seq for e in stream_events(url)) == list(range(5 * runs))
    verify_clean(url)


def test_the_recorder_refuses_an_out_of_range_seq_from_any_caller():
    rec = Recorder("tcp://127.0.0.1:1", "kv", {}, replayable=True)
    payload = encode("vllm", 1.0, Workload(47).batch(), 0)
    for frames in ([b"kv", ((1 << 63) - 1).to_bytes(8, "big"), payload], [b"kv", (-5).to_bytes(8, "big", signed=True),
                                                                         payload]):
        error = rec.live(frames)
        assert error is not None and error.code is ErrorCode.MALFORMED_EVENT
    assert rec.replayed([b"", b"kv", ((1 << 63) - 1).to_bytes(8, "big"), payload]) is not None
    with pytest.raises(Exception, match="MALFORMED_EVENT"):
        rec.message((1 << 63) - 1, payload, decode_batch_encoded(payload), replayed=False)
    assert (rec.summary.skipped, rec.summary.batches, rec.take()) == (3, 0, [])


# -- 5. a wrong topic ---------------------------------------------------------------------------

@pytest.mark.parametrize("dialect, seen", [("vllm", "kv"), ("sglang", "<no topic frame>")])
def test_a_wrong_topic_exits_1_and_names_the_topics_seen(tmp_path, dialect, seen):
    url = new_db(tmp_path)
    pub = Publisher(dialect)
    published: dict[tuple[int, int], list[Any]] = {}
    try:
        rec = record_cli(url, pub, "--idle-exit", "2", topic="kvx")
        _connected(pub)  # its replay asked at start is answered before anything is published
        publish_batches(pub, Workload(48), 20, published)
        out, err = rec.communicate(timeout=60)
    finally:
        pub.close()
    assert rec.returncode == 1, err.decode()
    s = _summary(out)
    assert s["batches"] == 0 and s["received"] == 0
    assert s["other_topics"] == 20 and s["topics_seen"] == {seen: 20}
    assert "no message on topic 'kvx'" in err.decode() and repr(seen) in err.decode()
    assert stream_events(url) == []


def test_the_topics_seen_are_bounded():
    rec = Recorder("tcp://127.0.0.1:1", "kv", {}, replayable=False)
    for i in range(1000):
        assert rec.live([f"t{i % 50}".encode(), (0).to_bytes(8, "big"), b""]) is None
    assert rec.summary.other_topics == 1000 and len(rec.summary.topics_seen) == 8
    assert rec.live([b"kv", (0).to_bytes(8, "big"), b"\xc1"]) is not None  # the topic's own: decoded, refused


def test_the_cli_defaults_are_the_recorders(tmp_path: Path):
    from kvledger import cmd_kv_events as cmd
    from kvledger.adapters import kv_events_recorder as r
    from kvledger.adapters import kv_events_zmq as z

    assert (cmd.MAX_HELD_BYTES, cmd.DEFAULT_RCVHWM) == (r.MAX_HELD_BYTES, z.RCVHWM)


def test_a_gap_written_before_schema_v2_still_reads_and_verifies():
    """kv_events_gap v2 added `code` and `size_bytes`: a v1 body (neither) is upcast on
    read, and is canonical as the older kvledger wrote it."""
    from kvledger.schemas.codec import decode_event, noncanonical

    rec = Recorder("tcp://127.0.0.1:1", "kv", {}, replayable=False)
    payload = encode("vllm", 1.0, Workload(49).batch(), 0)
    rec.message(3, payload, decode_batch_encoded(payload), replayed=False)
    gap = next(e for op in rec.take() for wr in op.writes for e in wr.events if isinstance(e, ev.KvEventsGapEvent))
    assert gap.schema_version == 2 and gap.payload.code is None
    v1 = encode_event(msgspec.structs.replace(gap, schema_version=1, global_position=1))
    assert b'"code"' not in v1 and b'"schema_version":1' in v1
    back = decode_event(v1)
    assert back.schema_version == 2 and back.payload == gap.payload
    assert noncanonical(v1, back) is None
