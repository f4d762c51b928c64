"""One commit's record, as SqlJournal writes it: its operations' events (a decode step as
a row, journal.steps), their compact receipts, the record's links and id runs, typed as
the `RecordRow` journal.statements inserts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import msgspec

from kvledger.journal.contract import Operation, Rejection
from kvledger.journal.keys import PREV_NONE, id_keys, id_runs, pack_prev
from kvledger.journal.manifests import manifest_ref, pack_manifest
from kvledger.journal.readback import compact_parts
from kvledger.journal.record_format import FORMAT, chain, encode_record
from kvledger.journal.step_rows import Row
from kvledger.journal.steps import StepWriter
from kvledger.schemas.codec import MAX_EVENT_BYTES, encode_event
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import RequestAllocate
from kvledger.schemas.receipts import HandleResult, Receipt


class RecordRow(NamedTuple):
    """One commit's row of kvl_records and what goes beside it."""

    last_position: int
    first_position: int
    chain: bytes  # keys.chain of the previous record's and this body
    body: bytes
    handles: list[str]  # the handles it writes, in the order its events first name them
    stream_prev: bytes  # each handle's record before this one (keys.pack_prev)
    id_runs: list[tuple[int, int]]  # its ids' keys as runs (keys.id_runs)


class Base(NamedTuple):
    """Where a record goes: after global position `last`, linked to `chain`, written at
    `now` (ns); `taken`: the batch's event ids already stored; `prevs`: the last record
    of each existing handle it may write (Statements.last_records; a handle not in it is
    new: PREV_NONE)."""

    last: int
    chain: bytes
    now: int
    taken: set[str]
    prevs: dict[str, int]


class Known(NamedTuple):
    """What the caller computed already of the batch's ids: their keys (keys.id_keys),
    each operation's event ids, and id_runs of every key (the record's when it writes
    them all)."""

    keys: dict[str, int]
    owned: list[list[str]]
    runs: list[tuple[int, int]]


class Written(NamedTuple):
    record: RecordRow | None  # None: every operation was decided already
    manifests: dict[str, bytes]  # kvl_manifests' rows
    position: int  # the last global position used
    tails: dict[str, tuple[int, int]]  # each handle written -> (its stream position, this record's last position)


def build_record(ops: Sequence[Operation], indexes: Iterable[int], results: list[Receipt | Rejection | None],
                 base: Base, known: Known | None = None) -> Written:
    """The record and the manifest rows of the operations at `indexes` not yet decided in
    `results`; fills in their receipts. An event id in `base.taken` (already stored) or
    written twice is CONSTRAINT_VIOLATION: nothing of the batch may commit (the caller's
    transaction rolls back)."""
    last, now = base.last, base.now
    keys, owned, all_runs = known if known is not None else (None, None, None)
    bodies: list[bytes | Row] = []  # events' JSON, and decode steps' rows (StepWriter.pack)
    receipts: list[bytes] = []
    tails: dict[str, int] = {}  # each handle written, in the order its events first name it
    event_ids: set[str] = set()  # the record's: an event id is unique (an operation id may equal one)
    op_ids: list[str] = []
    manifest_rows: dict[str, bytes] = {}
    allocated: dict[str, int] = {}  # manifest digest -> position of the event that holds it
    add_body, add_receipt = bodies.append, receipts.append
    encode, replace, encode_receipt = encode_event, msgspec.structs.replace, compact_parts
    steps = StepWriter(last + 1, now)
    step_row = steps.row
    position = last
    for i in indexes:
        if results[i] is not None:
            continue
        op = ops[i]
        op_id = op.operation_id
        first = position + 1
        own: list[str] = []
        handles: list[HandleResult] = []
        heads: list[int] = []  # the compact receipt's (records.compact_parts)
        row = step_row(op) if op.derived else None  # a decode step: one row (journal.steps)
        if row is not None:
            add_body(row)
            own += op.event_ids() if owned is None else owned[i]
            position += 3
        for write in op.writes:
            if row is None:
                for ev in op.write_events(write):
                    position += 1
                    stored = encode(replace(ev, global_position=position))
                    if len(stored) > MAX_EVENT_BYTES:  # decode_event refuses it: it would poison every read
                        raise _too_large(op, ev.event_id, len(stored))
                    add_body(stored)
                    own.append(ev.event_id)
                    if op.manifests and isinstance(ev.payload, RequestAllocate):
                        allocated[ev.payload.manifest_sha256] = position
            h = write.head
            tails[write.handle_id] = h.stream_position
            handles.append(HandleResult(write.handle_id, h.generation, h.snapshot_version,
                                        h.stream_position, h.committed_length))
            heads += (h.generation, h.snapshot_version, h.committed_length)
        receipt = Receipt(op_id, op.fingerprint, tuple(handles), tuple(own), first, position, now)
        if row is None:  # a row's receipt is rebuilt from it
            # A planned step whose digest or call id no row holds keeps its fingerprint, as
            # the general path that wrote such a step before (engine.batch_plan) did.
            derived = op.derived and (op.step is None or steps.formed(op.step))
            add_receipt(encode_receipt(len(own), None if derived else op.fingerprint, now, heads))
        event_ids.update(own)
        op_ids.append(op_id)
        for sha, manifest in op.manifests:  # where its allocation holds it, or itself
            manifest_rows[sha] = manifest_ref(allocated[sha]) if sha in allocated else pack_manifest(manifest)
        results[i] = receipt
    if not bodies:
        return Written(None, manifest_rows, position, {})
    if len(event_ids) != position - last or not base.taken.isdisjoint(event_ids):
        raise _reused_id(ops, op_ids, base.taken)
    receipts.append(steps.context())  # one format for every record: its Context with or without steps
    # pack passes a record without steps through as it is (all events' bytes)
    body = encode_record(steps.pack(bodies), receipts, FORMAT)
    written = event_ids.union(op_ids)
    if keys is None:
        runs = id_runs(id_keys(written))
    elif all_runs is not None and len(written) == len(keys):  # written is a subset of keys' ids
        runs = all_runs
    else:
        runs = id_runs([keys[i] for i in written])
    streams = list(tails)
    prev = pack_prev([base.prevs.get(h, PREV_NONE) for h in streams])
    record = RecordRow(position, last + 1, chain(base.chain, body), body, streams, prev, runs)
    return Written(record, manifest_rows, position, {h: (p, position) for h, p in tails.items()})


def _reused_id(ops: Sequence[Operation], written: list[str], taken: set[str]) -> KvLedgerError:
    """CONSTRAINT_VIOLATION naming the first event id that the batch's operations being
    written (their ids: `written`) reuse: one stored before, or one written twice."""
    seen: set[str] = set()
    new = set(written)
    for op in ops:
        if op.operation_id not in new:
            continue
        new.discard(op.operation_id)  # a repeat in the batch is a retry of the first
        for e in op.event_ids():
            if e in taken or e in seen:
                return KvLedgerError(ErrorCode.CONSTRAINT_VIOLATION, f"operation {op.operation_id}: event id {e} "
                                     f"is {'already in the journal' if e in taken else 'written twice'}")
            seen.add(e)
    return KvLedgerError(ErrorCode.CONSTRAINT_VIOLATION, "this batch reuses an event id")


def _too_large(op: Operation, event_id: str, size: int) -> KvLedgerError:
    return KvLedgerError(ErrorCode.FIELD_TOO_LARGE, f"operation {op.operation_id}: event {event_id} is "
                         f"{size} bytes stored, over the {MAX_EVENT_BYTES} a journal reads back")
