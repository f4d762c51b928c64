"""Fuzz of what a publisher can send the recorder (issue 44): arbitrary multipart frames
(counts, seq bytes, topics) and msgpack payloads of any shape (huge ints, nesting, NaN
times, bytes where strings go, near-valid batches with one field wrong), fed to the
Recorder's live and replay paths (Recorder.live / Recorder.replayed, what the socket loop
calls). Each message is decided or skipped with a code and counted, never an exception;
afterwards the journal verifies clean, replays, exports and imports. One real-socket case
sends a set of them through ZMQ to the recording loop."""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.adapters.kv_events_recorder import Recorder
from kvledger.cli import main
from kvledger.migrations.storage import open_or_create_journal
from kvledger.replay import export_jsonl, replay_journal
from kvledger.replay.metrics import WindowSpec
from kvledger.replay.sources import jsonl_events
from kvledger.replay.verify import verify_journal
from kvledger.schemas.errors import ErrorCode, KvLedgerError

SKIP_CODES = {ErrorCode.MALFORMED_EVENT, ErrorCode.CAPACITY_EXCEEDED}

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.integers(-300, 300),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.binary(max_size=40),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), inner,
                                                 max_size=4)), max_leaves=12)
hashes = st.lists(st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.binary(max_size=300), values), max_size=4)
names = st.one_of(st.none(), st.text(max_size=300), st.binary(max_size=8), values)
ints = st.one_of(st.none(), st.integers(-(1 << 63), (1 << 64) - 1), values)


@st.composite
def events(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Nope", 7, None]))
    fields = {
        "block_hashes": draw(hashes), "parent_block_hash": draw(st.one_of(st.none(), hashes.map(lambda h: h[:1])))
        if draw(st.booleans()) else None,
        "token_ids": draw(st.one_of(st.lists(st.integers(-(1 << 63), (1 << 64) - 1), max_size=6), values)),
        "block_size": draw(ints), "lora_id": draw(ints), "medium": draw(names), "lora_name": draw(names),
        "extra_keys": draw(values), "group_idx": draw(ints), "kv_cache_spec_kind": draw(names),
        "new_field": draw(values),
    }
    keep = draw(st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=len(fields)))
    if draw(st.booleans()):  # vLLM's tagged map
        return {"type": kind, **{k: fields[k] for k in keep}}
    return [kind, *[fields[k] for k in keep]]  # the positional form (fields in another order too)


good_hash = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.binary(min_size=1, max_size=256))
good_events = st.one_of(
    st.builds(lambda h, p, t, m, x: {"type": "BlockStored", "block_hashes": h, "parent_block_hash": p, "token_ids": t,
                                      "block_size": 16, "lora_id": None, "medium": m, "lora_name": None,
                                      **({"extra_keys": x} if x is not None else {})},
              st.lists(good_hash, min_size=1, max_size=3), st.one_of(st.none(), good_hash),
              st.lists(st.integers(0, 1 << 20), max_size=8), st.sampled_from([None, "GPU", "CPU"]),
              st.one_of(st.none(), values)),
    st.builds(lambda h, m: {"type": "BlockRemoved", "block_hashes": h, "medium": m},
              st.lists(good_hash, min_size=1, max_size=3), st.sampled_from([None, "GPU"])),
    st.just({"type": "AllBlocksCleared"}),
)


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    form = draw(st.sampled_from(["good", "good", "good", "batch", "map", "any", "raw"]))
    if form == "good":  # a batch the journal takes, in vLLM's form (the decisions: order, holes, restarts)
        return msgspec.msgpack.encode([draw(st.floats(-1e12, 1e12)), draw(st.lists(good_events, max_size=3)),
                                       draw(st.sampled_from([0, 0, 0, 1, None]))])
    ts = draw(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(1 << 63), (1 << 64) - 1),
                        values))
    evs = draw(st.lists(events(), max_size=4))
    rank = draw(st.one_of(st.none(), st.integers(-3, 3), st.integers(-(1 << 63), (1 << 64) - 1), values))
    if form == "batch":
        return msgspec.msgpack.encode([ts, evs, rank][:draw(st.integers(1, 4))])
    if form == "map":
        return msgspec.msgpack.encode({"ts": ts, "events": evs, "data_parallel_rank": rank})
    if form == "any":
        return msgspec.msgpack.encode(draw(values))
    return draw(st.binary(max_size=64))


@st.composite
def seqs(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=10))  # not 8 bytes
    seq = draw(st.one_of(st.integers(0, 12), st.sampled_from([-1, -2, (1 << 63) - 1, (1 << 63) - 2, -(1 << 63)]),
                         st.integers(-(1 << 63), (1 << 63) - 1)))
    return seq.to_bytes(8, "big", signed=True)


@st.composite
def messages(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    """(path, frames): a live PUB message, a replay reply as a DEALER gets it, or the end
    marker; mostly well-framed, some with any frames at all."""
    path = draw(st.sampled_from(["live", "live", "replayed", "end"]))
    if path == "end":
        return "replayed", [b"", (-1).to_bytes(8, "big", signed=True), b""]
    if draw(st.integers(0, 7)) == 0:
        return path, draw(st.lists(st.binary(max_size=16), max_size=5))
    topic = draw(st.sampled_from([b"kv", b"", b"kvx", b"\xff\xfe"]))
    body = [draw(seqs()), draw(payloads())]
    if path == "live":
        return path, ([topic] if draw(st.integers(0, 3)) else []) + body
    return path, [b""] + ([topic] if draw(st.booleans()) else []) + body


_TEMPLATE = tempfile.TemporaryDirectory()


def _empty_journal(d: Path) -> str:
    """A new, empty SQLite journal in `d`: a copy of one made once (making one takes ~0.1 s)."""
    template = Path(_TEMPLATE.name) / "empty.db"
    if not template.exists():
        with open_or_create_journal(f"sqlite:///{template}"):
            pass
    shutil.copyfile(template, d / "kv.db")
    return f"sqlite:///{d / 'kv.db'}"


def _check(rec: Recorder, path: str, frames: list[bytes]) -> None:
    error = rec.live(frames) if path == "live" else rec.replayed(frames)
    assert error is None or (isinstance(error, KvLedgerError) and error.code in SKIP_CODES), error


def _journal_is_whole(url: str, tmp: Path, *, imports: bool = True) -> None:
    """It verifies clean, replays, and exports lines that read back as the events stored."""
    with open_or_create_journal(url) as j:
        result = verify_journal(j)
        assert result.ok, result.findings
        replay_journal(j, WindowSpec(slo_ttft_ns=1, slo_tbt_ns=1))
        n = export_jsonl(j, tmp / "kv.jsonl")
        assert [e.global_position for e in jsonl_events(tmp / "kv.jsonl")] == list(range(1, n + 1))
    if imports:
        assert main(["import", "--db", f"sqlite:///{tmp / 'copy.db'}", str(tmp / "kv.jsonl")]) == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(topic=st.sampled_from(["kv", ""]), dialect=st.sampled_from([None, 3, 2]),
       cap=st.sampled_from([0, 4096, 1 << 20]), replayable=st.booleans(),
       msgs=st.lists(messages(), min_size=1, max_size=25))
def test_any_frames_are_decided_or_skipped_with_a_code_and_the_journal_stays_whole(topic, dialect, cap, replayable,
                                                                                  msgs):
    rec = Recorder("tcp://127.0.0.1:1", topic, {}, replayable=replayable, max_held_bytes=cap, frames=dialect)
    for path, frames in msgs:
        _check(rec, path, frames)
        if rec.replay_wanted is not None and not rec.replay_pending:
            rec.replay_sent()
    rec.stop()
    s = rec.summary
    assert s.held_batches == 0 and s.held_bytes == 0 and s.held_bytes_peak <= cap
    assert s.skipped == sum(s.skipped_codes.values())
    with tempfile.TemporaryDirectory() as d:
        url = _empty_journal(Path(d))
        with open_or_create_journal(url) as j:
            j.append(rec.take())
        _journal_is_whole(url, Path(d), imports=False)  # import: in the real-socket case


def test_hostile_frames_through_a_real_socket(tmp_path):
    """A fixed set of hostile messages sent live by a real publisher, between good batches:
    the recording loop goes on, skips and counts them, and the journal stays whole."""
    pytest.importorskip("zmq")
    from kv_publisher import Workload
    from kv_recording import new_db, recording, wait_for

    enc = msgspec.msgpack.encode
    seq = lambda n: n.to_bytes(8, "big", signed=True)  # noqa: E731 - a one-line helper of this test
    hostile = [
        [b"kv", seq(1), enc([math.nan, [], 0])],
        [b"kv", seq(1), enc([1.0, [{"type": "BlockStored", "block_hashes": [[1, [2, [3]]]]}], 0])],
        [b"kv", seq(1), enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "medium": b"\x00GPU"}], 0])],
        [b"kv", seq(1), enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "extra_keys": [[[[[[[1]]]]]]]}],
                             1.5])],
        [b"kv", seq(1), enc({"ts": 1.0, "events": [["BlockRemoved", [b"\x01"], 7, 8, 9]]})],
        [b"kv", seq((1 << 63) - 1), enc([1.0, [], 0])],
        [b"kv", b"\x00" * 7, enc([1.0, [], 0])],
        [b"kv", seq(1), b"\xc1\xc1"],
        [b"kv", seq(1), enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1 << 64 - 1]}],
                             "rank"])],
        [b"kv", seq(1), b"", b"extra frame"],
        [b"kv"],
    ]
    url = new_db(tmp_path)
    w = Workload(52)
    with recording(url, "vllm") as (pub, out):
        pub.publish(w.batch())
        for frames in hostile:
            pub.send(frames)
        pub.publish(w.batch())
        wait_for(url, 2, timeout=30)
        time.sleep(0.3)
    assert "error" not in out, out
    s = out["summary"]
    assert (s.batches, s.restarts, s.gaps, s.skipped) == (2, 0, 0, len(hostile))
    assert s.skipped_codes == {"MALFORMED_EVENT": len(hostile)}
    _journal_is_whole(url, tmp_path)
