"""The wire decoder accepts only what the journal reads back: a batch is stored as JSON and
read as a schemas.kv_events.KvEventsBatch, so a field past its limit, a NaN time or a
negative seq let through would be committed and then refused by every later replay,
verify and export. Each is refused with MALFORMED_EVENT, before anything is written."""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.adapters.kv_events_wire import decode_batch, decode_batch_encoded, split_live, split_replay
from kvledger.cli import main
from kvledger.schemas import kv_events as kv
from kvledger.schemas.errors import ErrorCode, KvLedgerError

read_back = msgspec.json.Decoder(kv.KvEventsBatch).decode


def _stored(**fields: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "token_ids": [1, 2], "block_size": 2, **fields}


HOSTILE = {
    "a medium past 256 characters": [1.0, [_stored(medium="m" * 257)], 0],
    "a lora name past 256 characters": [1.0, [_stored(lora_name="n" * 300)], 0],
    "a bytes hash past 256 bytes": [1.0, [{"type": "BlockRemoved", "block_hashes": [b"\x02" * 257]}], 0],
    "a bytes parent hash past 256 bytes": [1.0, [_stored(parent_block_hash=b"\x03" * 300)], 0],
    "a negative block size": [1.0, [_stored(block_size=-1)], 0],
    "a NaN time": [math.nan, [_stored()], 0],
    "an infinite time": [math.inf, [], None],
    "the array form with a long medium": [1.0, [["BlockStored", [b"\x01" * 32], None, [1], 1, None, "m" * 400]], 0],
    "the map batch with a NaN time": {"ts": math.nan, "events": [], "data_parallel_rank": 0},
    # bytes where a string goes: JSON would keep them as base64 text, another value
    "a bytes medium": [1.0, [_stored(medium=b"GPU")], 0],
    "a bytes lora name in the array form": [1.0, [["BlockStored", [b"\x01"], None, [1], 1, None, "GPU", b"l"]], 0],
    "a bytes cache spec kind": [1.0, [_stored(kv_cache_spec_kind=b"full")], None],
}


@pytest.mark.parametrize("payload", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_batch_the_journal_could_not_read_back_is_refused(payload):
    with pytest.raises(KvLedgerError) as info:
        decode_batch(msgspec.msgpack.encode(payload))
    assert info.value.code == ErrorCode.MALFORMED_EVENT


SHAPES = {
    "a batch that is a number": (5, "payload is not an EventBatch"),
    "an event that is a number": ([1.0, [7], 0], "a KV event is a map tagged by 'type'"),
    "block hashes that are not a list": ([1.0, [_stored(block_hashes=5)], 0], "block_hashes is not a list"),
}


@pytest.mark.parametrize("payload, says", SHAPES.values(), ids=SHAPES.keys())
def test_a_batch_of_another_shape_is_refused_saying_what(payload, says):
    with pytest.raises(KvLedgerError) as info:
        decode_batch(msgspec.msgpack.encode(payload))
    assert info.value.code == ErrorCode.MALFORMED_EVENT and says in info.value.message


def test_a_replay_reply_of_one_frame_is_refused():
    with pytest.raises(KvLedgerError) as info:
        split_replay([b"payload"])
    assert info.value.code == ErrorCode.MALFORMED_EVENT and "at least 2 frames" in info.value.message


def test_the_limits_themselves_are_accepted_and_read_back():
    """The refusals above are the limits, not one off: each field at its limit passes."""
    payload = [1.0, [_stored(medium="m" * 256, lora_name="n" * 256, parent_block_hash=b"\x03" * 256,
                             block_hashes=[b"\x02" * 256, 2**64 - 1], block_size=0)], 3]
    ts, events, rank = decode_batch(msgspec.msgpack.encode(payload))
    batch = kv.KvEventsBatch(0, 7, ts, events, rank)
    assert read_back(msgspec.json.encode(batch)) == batch
    assert events[0].block_hashes == ("02" * 256, 2**64 - 1)


@pytest.mark.parametrize("frames", [[b"kv", (-2).to_bytes(8, "big", signed=True), b"x"],
                                    [(-1).to_bytes(8, "big", signed=True), b"x"],
                                    [b"kv", ((1 << 63) - 1).to_bytes(8, "big"), b"x"]])
def test_a_live_seq_outside_0_to_2_63_minus_2_is_refused(frames):
    with pytest.raises(KvLedgerError) as info:
        split_live(frames)
    assert info.value.code == ErrorCode.MALFORMED_EVENT


def test_a_negative_replayed_seq_is_refused_and_the_end_marker_is_not():
    assert split_replay([b"", (-1).to_bytes(8, "big", signed=True), b""]) is None
    with pytest.raises(KvLedgerError) as info:
        split_replay([b"", b"kv", (-3).to_bytes(8, "big", signed=True), b"payload"])
    assert info.value.code == ErrorCode.MALFORMED_EVENT


def test_import_of_an_unreadable_batch_writes_nothing(tmp_path, capsys):
    good = {"seq": 0, "ts": 1.0, "events": [{"type": "BlockStored", "block_hashes": ["00ff"], "token_ids": [1],
                                             "block_size": 1}]}
    bad = {**good, "seq": 1, "events": [{**good["events"][0], "medium": "x" * 1000}]}
    f = tmp_path / "kv.jsonl"
    f.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    db = tmp_path / "kv.db"
    assert main(["kv-events", "import", str(f), "--dialect", "vllm", "--db", f"sqlite:///{db}"]) == 2
    assert "MALFORMED_EVENT" in capsys.readouterr().err
    assert not db.exists()  # all or nothing: a refused import leaves no journal behind


# -- every batch the decoder accepts reads back -----------------------------------------

_text = st.text(max_size=3) | st.builds(lambda n: "m" * n, st.integers(250, 260))
_hash = st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=3) | st.builds(lambda n: b"\x07" * n,
                                                                               st.integers(250, 260))
_any = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.floats() | _text | st.binary(max_size=4),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                  max_size=3), max_leaves=8)
_optional = {"parent_block_hash": _hash, "token_ids": st.lists(st.integers(-3, 3), max_size=4),
             "block_size": st.integers(-2, 64), "lora_id": st.integers(-2, 2), "medium": _text, "lora_name": _text,
             "extra_keys": _any, "group_idx": st.integers(-2, 2), "kv_cache_spec_kind": _text,
             "kv_cache_spec_sliding_window": st.integers(-2, 2), "a_newer_field": _any}


@st.composite
def _event(draw: Any) -> Any:
    kind = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]))
    fields: dict[str, Any] = {}
    if kind != "AllBlocksCleared":
        fields["block_hashes"] = draw(st.lists(_hash, max_size=3))
    names = list(_optional) if kind == "BlockStored" else ["medium", "group_idx"]
    for name in draw(st.lists(st.sampled_from(names), unique=True, max_size=4)):
        fields[name] = draw(_optional[name])
    if draw(st.booleans()):
        return {"type": kind, **fields}
    return [kind, *fields.values()]  # the array form: positions, so mostly refused or reshuffled


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ts=st.floats(), events=st.lists(_event(), max_size=4), rank=st.none() | st.integers(-3, 3))
def test_every_accepted_batch_reads_back(ts, events, rank):
    payload = msgspec.msgpack.encode([ts, events, rank])
    try:
        ts_, decoded, rank_ = decode_batch(payload)
    except KvLedgerError as exc:
        assert exc.code == ErrorCode.MALFORMED_EVENT
        return
    batch = kv.KvEventsBatch(0, 0, ts_, decoded, rank_)
    again = read_back(msgspec.json.encode(batch))  # raises if the journal could not read it
    assert again.events == batch.events  # what the recorder journals is what replay will read
    # The live recorder's form journals the same bytes.
    ts_e, encoded, rank_e = decode_batch_encoded(payload)
    assert (ts_e, rank_e, encoded.count) == (ts_, rank_, len(decoded))
    assert msgspec.json.encode(kv.KvEventsBatch(0, 0, ts_e, encoded.json, rank_e)) == msgspec.json.encode(batch)
