"""Record format 6's step rows (journal.steps): a decode step stored as one row reads back
as the exact bytes format 5 stored for it (its three events' JSON, its receipt), or is
not stored as a row at all.

- Generated runs of decode steps, each possibly off in one field (a type, a relation the
  rebuild assumes, an id the row cannot hold): for every step `StepWriter.row` accepts,
  the rebuilt events and receipt are byte for byte the originals'; and the plain worker
  form is accepted, so the comparison means something.
- A real service and journal on both backends (the bench's lockstep decode): every
  event `read_raw` returns is the JSON of what the service stamped, `read_all` decodes
  to the same events, and every receipt reads back as the writer returned it.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.journal.audit import audit_record, decode_record, unpack_record
from kvledger.journal.blocks import pack
from kvledger.journal.contract import Guard, HeadFacts, Operation, StreamWrite
from kvledger.journal.readback import Damage
from kvledger.journal.record_format import FORMAT
from kvledger.journal.steps import (
    MARK,
    VERSIONS,
    Call,
    Context,
    StepReader,
    StepValues,
    StepWriter,
    decode_context,
    is_row,
)
from kvledger.schemas import events as ev
from kvledger.schemas.codec import decode_event, encode_event
from kvledger.schemas.decode_fingerprint import decode_chain_fingerprint
from kvledger.schemas.receipts import HandleResult, Receipt, receipt_encoder

from lane_helpers import watch_appends
from stored_rows import records

U64 = st.integers(0, (1 << 64) - 1)
HEX16 = st.text("0123456789abcdef", min_size=16, max_size=16)
ABI = "c7" * 32

# One field of one event set to a value the rebuild does not derive that way (or a
# type that encodes otherwise): the writer must then store the step as events.
OFF = {
    "publish.result_snapshot_version": lambda p: p + 2,
    "publish.logits_ready": lambda _: 1,
    "publish.accepted_count": lambda _: True,
    "publish.workspace_bytes": lambda _: 2.0,
    "publish.rows_sha256": lambda _: "ab" * 31 + "a",  # 63 digits: no 32 bytes
    "publish.txn_id": lambda _: "txn-7",
    "emit.snapshot_version": lambda v: v + 1,
    "emit.token_id": lambda t: t + 1,
    "start.interval_start": lambda t: t + 1,
    "start.mask_key_extent": lambda m: float(m),
    "start.token_ids": lambda ts: ts + ts,
    "start.cache_positions": lambda ps: (ps[0], ps[0] + 1),
    "start.kind": lambda _: "chunk",
    "start.cache_abi_sha256": lambda _: "c7" * 33,
    "start.txn_id": lambda t: t.upper() if t.upper() != t else t + "0",
    "envelope.emit.monotonic_ns": lambda m: m + 1,
    "envelope.start.observed_wall_time": lambda w: w - 1,
    "envelope.emit.local_sequence": lambda s: s + 2,
    "envelope.start.stream_position": lambda p: p + 1,
    "envelope.publish.caused_by_event_id": lambda _: "e-1",
    "envelope.emit.schema_version": lambda _: VERSIONS[1] + 1,
    "envelope.start.request_id": lambda r: r + "x",
    "envelope.publish.event_id": lambda e: "ffffffffffffffff" + e[16:],
    "head.committed_length": lambda c: c + 1,
}


@st.composite
def steps(draw):
    """A run of decode steps as the service stamps them, some of them off in one field."""
    prefix, txns = draw(HEX16), draw(HEX16)
    counter = draw(st.integers(0, (1 << 64) - 4096))
    seq, mono, wall = draw(st.integers(0, 1 << 40)), draw(st.integers(0, 1 << 62)), draw(st.integers(0, 1 << 62))
    call_id = f"{prefix}{draw(U64):016x}" if draw(st.booleans()) else None
    out = []
    for i in range(draw(st.integers(1, 6))):
        stream = draw(st.sampled_from(["h0", "h1", "h2"]))
        v, c, pos = draw(st.integers(0, 1 << 20)), draw(st.integers(1, 1 << 20)), draw(st.integers(0, 1 << 20))
        token = draw(st.integers(0, (1 << 63) - 1))
        counter += draw(st.integers(1, 9))
        seq += 3 + draw(st.integers(-2, 5))
        mono = max(0, mono + draw(st.integers(-1000, 1 << 30)))  # the clocks may step back
        wall = max(0, wall + draw(st.integers(-1000, 1 << 30)))
        ids = [f"{prefix}{counter + k:016x}" for k in range(4)]
        counter += 3
        env = dict(stream_id=stream, request_id=f"req-{stream}", handle_generation=draw(st.integers(0, 3)),
                   operation_id=ids[0], source_instance=draw(st.sampled_from(["kvledger", "worker-2"])),
                   monotonic_ns=mono, observed_wall_time=wall)
        call = None if call_id is None else ev.ForwardCall(
            call_id=call_id, index=i, size=draw(st.integers(1, 64)), new_pad=1, key_extent=c + 1,
            threads=draw(st.integers(0, 4)))
        publish = ev.AppendPublishEvent(
            event_id=ids[1], stream_position=pos, schema_version=VERSIONS[0], local_sequence=seq, **env,
            payload=ev.AppendPublish(
                txn_id=f"{txns}{draw(U64):016x}", base_snapshot_version=v, result_snapshot_version=v + 1,
                committed_length=c, accepted_count=draw(st.integers(1, 64)), layers_complete=draw(st.integers(1, 80)),
                logits_ready=True, workspace_bytes=draw(st.integers(0, 1 << 40)),
                rows_sha256=draw(st.one_of(st.none(), st.binary(min_size=32, max_size=32).map(bytes.hex)))))
        emit = ev.OutputEmitEvent(
            event_id=ids[2], stream_position=pos + 1, schema_version=VERSIONS[1], local_sequence=seq + 1, **env,
            payload=ev.OutputEmit(output_index=draw(st.integers(0, 1 << 20)), token_id=token,
                                  snapshot_version=v + 1))
        start = ev.AppendStartEvent(
            event_id=ids[3], stream_position=pos + 2, schema_version=VERSIONS[2], local_sequence=seq + 2, **env,
            payload=ev.AppendStart(
                txn_id=f"{txns}{draw(U64):016x}", kind="decode", base_snapshot_version=v + 1, interval_start=c,
                interval_count=1, token_ids=(token,), cache_positions=(c,), mask_key_extent=c + 1,
                cache_abi_sha256=ABI, call=call))
        head = HeadFacts(env["request_id"], env["handle_generation"], v + 1, pos + 2, c, "ACTIVE", "p" * 64, ABI)
        off = draw(st.one_of(st.none(), st.sampled_from(sorted(OFF))))
        events, head = _off(off, [publish, emit, start], head)
        out.append((off, events, head))
    return out


def _off(off: str | None, events: list, head: HeadFacts):
    if off is None:
        return events, head
    parts = off.split(".")
    if parts[0] == "head":
        return events, msgspec.structs.replace(head, **{parts[1]: OFF[off](getattr(head, parts[1]))})
    if parts[0] == "envelope":
        k = ("publish", "emit", "start").index(parts[1])
        e = events[k]
        events[k] = msgspec.structs.replace(e, **{parts[2]: OFF[off](getattr(e, parts[2]))})
        return events, head
    k = ("publish", "emit", "start").index(parts[0])
    e = events[k]
    payload = msgspec.structs.replace(e.payload, **{parts[1]: OFF[off](getattr(e.payload, parts[1]))})
    events[k] = msgspec.structs.replace(e, payload=payload)
    return events, head


@settings(max_examples=300, deadline=None)
@given(steps(), st.integers(1, 1 << 40), st.integers(0, 1 << 62))
def test_a_row_rebuilds_its_step_byte_for_byte_or_is_not_written(run, first, now):
    writer = StepWriter(first, now)
    runs: list[list] = [[]]  # each run of rows: (row, its events' first position, the events, the receipt)
    position = first
    for off, events, head in run:
        p = events[0]
        op = Operation(p.operation_id, decode_chain_fingerprint(*events),
                       (StreamWrite(p.stream_id, Guard(0, 0, 0), head, tuple(events)),), derived=True)
        row = writer.row(op)
        # the plain worker form is always a row; each way off above, never (a row would
        # rebuild it otherwise, which the loop below would catch anyway)
        assert (row is None) == (off is not None), off
        if row is None:
            position += 3  # stored as events, between two blocks; the rows after it still count it
            runs.append([])
            continue
        stamped = [msgspec.structs.replace(e, global_position=position + k) for k, e in enumerate(events)]
        receipt = Receipt(op.operation_id, op.fingerprint, (HandleResult(
            p.stream_id, head.generation, head.snapshot_version, head.stream_position, head.committed_length),),
            tuple(e.event_id for e in events), position, position + 2, now)
        runs[-1].append((row, position - first, stamped, receipt))
        position += 3
    # read back as a fold reads them (columns) and as read_all does, each by its own reader
    for columns in (True, False):
        reader = StepReader(writer.context())
        for written in filter(None, runs):
            block = pack([row for row, *_ in written])
            assert block[0] == MARK and is_row(block)  # an item that is no JSON event
            values = reader.block(block, written[0][1], columns).values()
            assert len(values) == len(written)
            for x, (_, _, stamped, receipt) in zip(values, written):
                rebuilt = x.events()
                assert [encode_event(e) for e in rebuilt] == [encode_event(e) for e in stamped]
                assert [decode_event(encode_event(e)) for e in stamped] == list(rebuilt)
                assert reader.receipt(rebuilt) == receipt_encoder.encode(receipt)


@pytest.mark.parametrize("layers", [2, 32])
def test_a_lockstep_journal_reads_back_what_was_stamped(db_url, layers):
    """The bench's 64 handles decoding in lockstep through a real service and journal."""
    from kvledger.engine.service import CommandService
    from kvledger.migrations.storage import open_or_create_journal

    from bench.tokens import Lockstep

    stamped: list[Operation] = []
    returned: list[Receipt] = []
    with open_or_create_journal(db_url) as journal:
        def record(ops, results):
            stamped.extend(op for op, r in zip(ops, results) if isinstance(r, Receipt))
            returned.extend(r for r in results if isinstance(r, Receipt))

        watch_appends(journal, record)  # what the service writes
        run = Lockstep(CommandService(journal), layers, 6, "steps")
        for _ in range(5):
            run.step()
        expected = {}
        for op, r in zip(stamped, returned):
            events = [e for w in op.writes for e in op.write_events(w)]
            for k, e in enumerate(events):
                expected[r.first_global_position + k] = encode_event(
                    msgspec.structs.replace(e, global_position=r.first_global_position + k))
        raw = list(journal.read_raw())
        assert raw == sorted(expected.items())
        assert list(journal.read_all()) == [decode_event(b) for _, b in raw]
        assert [journal.receipt(r.operation_id) for r in returned] == returned
    bodies = [r.body for r in records(db_url)]
    assert [unpack_record(b).format for b in bodies][-5:] == [FORMAT] * 5
    assert sum(decode_record(b, "t").step_rows for b in bodies) == 5 * 64  # every decode step a row
    receipts = []
    for b in bodies:
        audited = audit_record(b)
        assert not isinstance(audited, Damage)
        receipts += audited.receipts
    assert receipts == [receipt_encoder.encode(r) for r in returned]


# StepValues fields a block stores as they are (journal.blocks' columns 5-17): a count
# (>= 0) that must fit an int64. The call's five come from its Call.
_COUNTS = ("stream_position", "snapshot", "committed", "accepted", "layers", "workspace", "output", "token")
_CALL_COUNTS = ("index", "threads", "size", "new_pad", "key_extent")


def _step_values(**change: object) -> StepValues:
    call_change = {k: change.pop(k) for k in _CALL_COUNTS if k in change}
    call = ("ab" * 8, 12, Call(0, 0, **{"index": 1, "threads": 2, "size": 8, "new_pad": 1, "key_extent": 41,
                                       **call_change}))
    fields = dict(global_position=0, stream_id="h0", request_id="req-h0", handle_generation=1,
                  source_instance="kvledger", cache_abi_sha256=ABI, stream_position=10, local_sequence=100,
                  monotonic_ns=1000, observed_wall_time=2000, prefix="ab" * 8, op=7, gaps=(0, 0, 0),
                  publish_txn="cd" * 8 + "0" * 16, start_txn="cd" * 8 + "0" * 15 + "1", snapshot=3, committed=40,
                  accepted=1, layers=2, workspace=0, digest=None, output=5, token=9, call=call)
    return StepValues(**{**fields, **change})


@pytest.mark.parametrize("field", _COUNTS + _CALL_COUNTS)
def test_a_count_a_block_cannot_hold_is_stored_as_events(field):
    """values_row refuses (None: the step is stored as its events) a count below 0 or past
    int64, and takes the greatest int64, stored in its column as it is."""
    assert StepWriter(1, 0).values_row(_step_values()) is not None
    for bad in (-1, 1 << 63):
        assert StepWriter(1, 0).values_row(_step_values(**{field: bad})) is None, (field, bad)
    row = StepWriter(1, 0).values_row(_step_values(**{field: (1 << 63) - 1}))
    assert row is not None
    assert row[0][5 + (_COUNTS + _CALL_COUNTS).index(field)] == (1 << 63) - 1
    assert pack([row])  # and a block holds it


@pytest.mark.parametrize("gap", range(3))
def test_a_gap_a_block_cannot_hold_is_stored_as_events(gap):
    """The three gaps are stored as they are (columns 24-26): any int64, no more."""
    def gaps(v: int) -> tuple[int, ...]:
        return tuple(v if i == gap else 0 for i in range(3))
    for bad in (-(1 << 63) - 1, 1 << 63):
        assert StepWriter(1, 0).values_row(_step_values(gaps=gaps(bad))) is None, bad
    for edge in (-(1 << 63), (1 << 63) - 1):
        row = StepWriter(1, 0).values_row(_step_values(gaps=gaps(edge)))
        assert row is not None and row[0][24 + gap] == edge


# Stream tables that records share, and ones of the same length that differ in one byte
# (a request id's last character): decode_context may reuse a table only when its bytes match.
_TABLES = [[("h-1", "r-1", 0, "src", bytes(32)), ("h-2", "r-2", 1, "src", b"\x01" * 32)],
           [("h-1", "r-1", 0, "src", bytes(32)), ("h-2", "r-3", 1, "src", b"\x01" * 32)],
           [("h-1", "r-1", 0, "src", bytes(32))]]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1 << 40), st.lists(st.text(max_size=3), max_size=2)),
                min_size=1, max_size=12))
def test_a_context_decodes_as_its_struct_whatever_tables_came_before(seq):
    exact = msgspec.msgpack.Decoder(Context).decode
    for table, position, prefixes in seq:
        data = msgspec.msgpack.encode(Context(position, position + 1, prefixes, _TABLES[table]))
        assert decode_context(data) == exact(data)
