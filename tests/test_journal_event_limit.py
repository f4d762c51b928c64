"""The journal's append refuses an event it could not read back (issue 44): a stored
encoding over schemas.codec.MAX_EVENT_BYTES is FIELD_TOO_LARGE and nothing is written,
on either path of the append (a new stream; a guarded write on one the connection knows,
which SQLite takes in one round trip), on both backends."""

from __future__ import annotations

import os

import msgspec
import pytest

from kvledger.journal.contract import Operation, Receipt
from kvledger.migrations.storage import open_or_create_journal
from kvledger.replay.verify import verify_journal
from kvledger.schemas.codec import MAX_EVENT_BYTES, encode_event
from kvledger.schemas.errors import ErrorCode, KvLedgerError

from kv_publisher import Workload, encode


def _ops(recorder_seq: list[int], stream: str) -> list[Operation]:
    from kvledger.adapters.kv_events_recorder import Recorder
    from kvledger.adapters.kv_events_wire import decode_batch_encoded

    rec = Recorder(f"tcp://127.0.0.1:1/{stream}", "kv", {}, replayable=False)
    w = Workload(3)
    for seq in recorder_seq:
        payload = encode("vllm", 1.0 + seq, w.batch(), 0)
        rec.message(seq, payload, decode_batch_encoded(payload), replayed=False)
    return rec.take(group=1)


_HEX = os.urandom(MAX_EVENT_BYTES // 2 + 1).hex().encode()  # incompressible: the record stays near its size


def _sized(op: Operation, extra: int) -> Operation:
    """`op` with its one batch's events replaced by a valid one whose extra_keys (any JSON)
    is a string of `extra` hex digits: its stored size is the op's at extra=0 plus extra."""
    big = msgspec.Raw(b'[{"type":"BlockStored","block_hashes":[],"extra_keys":"' + _HEX[:extra] + b'"}]')
    (w,) = op.writes
    (e,) = w.events
    e = msgspec.structs.replace(e, payload=msgspec.structs.replace(e.payload, events=big))
    return msgspec.structs.replace(op, writes=(msgspec.structs.replace(w, events=(e,)),))


def _fill(op: Operation, position: int, size: int) -> Operation:
    """`op` (one event, written at global `position`) grown to `size` bytes stored."""
    stored = len(encode_event(msgspec.structs.replace(_sized(op, 0).writes[0].events[0], global_position=position)))
    return _sized(op, size - stored)


def _state(j):
    return list(j.read_raw()), j.heads(), j.last_position()


def test_an_event_over_the_limit_is_refused_and_nothing_is_written(db_url):
    with open_or_create_journal(db_url) as j:
        first, second = _ops([0, 1], "a")
        assert isinstance(j.append([first])[0], Receipt)
        before = _state(j)
        # a guarded write on a stream this connection just wrote (the one-round-trip path)
        with pytest.raises(KvLedgerError) as info:
            j.append([_fill(second, 2, MAX_EVENT_BYTES + 1)])
        assert info.value.code is ErrorCode.FIELD_TOO_LARGE and str(MAX_EVENT_BYTES) in str(info.value)
        assert _state(j) == before
        # a new stream in a batch with a good operation: all of the batch is refused
        (fresh,) = _ops([0], "b")
        with pytest.raises(KvLedgerError) as info:
            j.append([second, _fill(fresh, 3, MAX_EVENT_BYTES + 1)])
        assert info.value.code is ErrorCode.FIELD_TOO_LARGE
        assert _state(j) == before
        if db_url.startswith("nats"):  # a record is one message: the servers' max_payload (64 MB at most) is less
            with pytest.raises(KvLedgerError) as info:
                j.append([_fill(second, 2, MAX_EVENT_BYTES), fresh])
            assert info.value.code is ErrorCode.FIELD_TOO_LARGE and _state(j) == before
            return
        # at exactly the limit it is written, and the journal reads back whole
        assert all(isinstance(r, Receipt) for r in j.append([_fill(second, 2, MAX_EVENT_BYTES), fresh]))
        events = list(j.read_all())
        assert [len(encode_event(e)) for e in events] == [len(encode_event(events[0])), MAX_EVENT_BYTES,
                                                          len(encode_event(events[2]))]
        result = verify_journal(j)
        assert result.ok, result.findings




def test_a_batch_that_compresses_past_1024x_reads_back(db_url, tmp_path):
    """A wire-valid batch of a million zero token ids (2 MB of JSON) compresses ~10,000x:
    its record reads back, verifies, exports and imports (the reader's bound on how far a
    record may inflate is zstd's own largest ratio, not a smaller guess)."""
    from kvledger.adapters.kv_events_recorder import Recorder
    from kvledger.adapters.kv_events_wire import decode_batch_encoded
    from kvledger.cli import main

    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [0] * 1_000_000,
                                             "block_size": 16}], 0])
    rec = Recorder("tcp://127.0.0.1:1", "kv", {}, replayable=False)
    rec.message(0, payload, decode_batch_encoded(payload), replayed=False)
    with open_or_create_journal(db_url) as j:
        assert isinstance(j.append(rec.take())[0], Receipt)
        (e,) = j.read_all()
        assert e.payload.events[0].token_ids == (0,) * 1_000_000
        result = verify_journal(j)
        assert result.ok, result.findings
    out = tmp_path / "kv.jsonl"
    assert main(["export", "--db", db_url, "--out", str(out)]) == 0
    assert main(["import", "--db", f"sqlite:///{tmp_path / 'copy.db'}", str(out)]) == 0


def test_a_record_the_reader_would_refuse_is_never_packed():
    """A commit whose record would hold more than journal.inflate.MAX_RECORD_BYTES (every
    reader refuses such a record as damage) is FIELD_TOO_LARGE when packed, before any
    compression: a commit of many large events would otherwise be acknowledged and then
    poison every read."""
    from kvledger.journal import inflate
    from kvledger.journal.audit import unpack_record
    from kvledger.journal.readback import RecordParts
    from kvledger.journal.record_format import FORMAT, pack_record

    lists = 4 * 4  # one event, one receipt: four 4-byte list entries
    data = bytes(inflate.MAX_RECORD_BYTES - lists + 1)
    parts = RecordParts(FORMAT, [len(data) - 1], [0], [1], [0], data)
    with pytest.raises(KvLedgerError) as info:
        pack_record(parts)
    assert info.value.code == ErrorCode.FIELD_TOO_LARGE
    del data, parts
    small = RecordParts(FORMAT, [3], [0], [1], [0], b"abcd")
    assert unpack_record(pack_record(small)).data == b"abcd"
