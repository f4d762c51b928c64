"""verify: every invariant of the journal, checked over the whole event sequence.

A pure checker. It reads stored bodies (so an undecodable line is a finding, not a
crash), folds each stream with the same `engine.evolve` the service uses, and before
applying an event checks that the event is one `decide` could have produced from the
state so far. Each finding names the event it points to. An event that cannot be
applied (a publish of a transaction that never started, anything after release) is
reported and skipped, so one bad line does not hide the rest of the journal.

Codes reuse schemas.errors names where the invariant is the same rule the command
path enforces (STALE_BASE, APPEND_HOLE, ABI_MISMATCH, ...); the others are in
replay.findings, the rules per event type in replay.verify_rules.

A database is audited in layers, all read in one snapshot (Journal.snapshot): the
database's own storage check (STORAGE_CORRUPT), then per row the stored form (types,
canonical bytes, indexed columns against the body: replay.stored), then the event
invariants, then the tables derived from events (receipts, heads). A check over stored
bytes across rows (a digest chain) belongs to the per-row layer, in `Checker.feed`.

Findings are bounded: the first `keep` are kept, the rest counted, and reading stops
after STOP_AFTER findings, so a file of junk (or /dev/urandom) ends with a count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec

from kvledger.engine.evolve import evolve
from kvledger.engine.heads import head as head_facts  # the head row exactly as the service writes it
from kvledger.engine.state import HandleState
from kvledger.journal.contract import HeadFacts, StoredDamage, StoredEvent, StoredReceipt
from kvledger.journal.port import Journal
from kvledger.replay import anchor as anchors
from kvledger.replay.findings import (
    ANCHOR_MISMATCH,
    B_TOKEN_MISMATCH,
    COLUMN_MISMATCH,
    COMMITTED_EXCEEDS_LOGICAL,
    COMMITTED_LENGTH_MISMATCH,
    COUNT_MISMATCH,
    DUPLICATE_EVENT_ID,
    DUPLICATE_TXN,
    EVENT_AFTER_RELEASE,
    FAILURE_CHANGES_STATE,
    FAILURE_WITHOUT_START,
    GENERATION_MISMATCH,
    GENERATION_REGRESSION,
    HEAD_MISMATCH,
    KEEP,
    KV_EPOCH_ORDER,
    KV_SEQ_ORDER,
    MALFORMED_RECEIPT,
    MANIFEST_MISSING,
    NON_CANONICAL,
    OPEN_TXN_AT_CLOSE,
    OPERATION_NOT_CONTIGUOUS,
    OUTPUT_INDEX_GAP,
    POSITION_GAP,
    PUBLISH_WITHOUT_START,
    RECEIPT_MISMATCH,
    RECEIPT_MISSING,
    RECLAIMABLE_EXCEEDS_RESIDENT,
    RELEASE_LENGTH_MISMATCH,
    REORDER_MISMATCH,
    REQUEST_MISMATCH,
    RESERVED_BELOW_COMMITTED,
    SNAPSHOT_DISCONTINUITY,
    STOP_AFTER,
    STORAGE_CORRUPT,
    STORED_TYPE_MISMATCH,
    STREAM_POSITION_GAP,
    TAMPERED,
    TIME_REGRESSION,
    UNKNOWN_STREAM,
    VISIBLE_BEYOND_COMMITTED,
    WORK_AFTER_FINISH,
    Finding,
    VerifyResult,
)
from kvledger.replay.kv_blocks import kv_head_facts
from kvledger.replay.sources import jsonl_bodies
from kvledger.replay.stored import column_problems, names, position_of, receipt_problems, short
from kvledger.replay.verify_rules import EventRules
from kvledger.schemas import events as ev
from kvledger.schemas import kv_events as kv
from kvledger.schemas.codec import decode_event, noncanonical
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.ids import id_problem
from kvledger.schemas.receipts import Receipt

# The public API as before the split: the finding codes are replay.findings'.
__all__ = [
    "Checker", "ANCHOR_MISMATCH", "B_TOKEN_MISMATCH", "COLUMN_MISMATCH", "COMMITTED_EXCEEDS_LOGICAL",
    "COMMITTED_LENGTH_MISMATCH", "COUNT_MISMATCH", "DUPLICATE_EVENT_ID", "DUPLICATE_TXN",
    "EVENT_AFTER_RELEASE", "FAILURE_CHANGES_STATE", "FAILURE_WITHOUT_START", "Finding", "GENERATION_MISMATCH",
    "GENERATION_REGRESSION", "HEAD_MISMATCH", "KEEP", "KV_EPOCH_ORDER", "KV_SEQ_ORDER", "MALFORMED_RECEIPT",
    "MANIFEST_MISSING", "NON_CANONICAL", "OPEN_TXN_AT_CLOSE", "OPERATION_NOT_CONTIGUOUS", "OUTPUT_INDEX_GAP",
    "POSITION_GAP", "PUBLISH_WITHOUT_START", "RECEIPT_MISMATCH", "RECEIPT_MISSING",
    "RECLAIMABLE_EXCEEDS_RESIDENT", "RELEASE_LENGTH_MISMATCH", "REORDER_MISMATCH", "REQUEST_MISMATCH",
    "RESERVED_BELOW_COMMITTED", "SNAPSHOT_DISCONTINUITY", "STOP_AFTER", "STORAGE_CORRUPT",
    "STORED_TYPE_MISMATCH", "STREAM_POSITION_GAP", "TAMPERED", "TIME_REGRESSION", "UNKNOWN_STREAM",
    "VISIBLE_BEYOND_COMMITTED", "VerifyResult", "WORK_AFTER_FINISH", "verify_bodies", "verify_journal",
    "verify_jsonl"
]

# Payload fields only a state-changing event carries: on a failure they claim a change.
_STATE_FIELDS = ("result_snapshot_version", "committed_length", "accepted_count", "layers", "layers_complete",
                 "new_length", "result_generation", "released_length")


class _Op(msgspec.Struct):
    first: int
    last: int
    event_ids: list[str]
    handles: dict[str, tuple[int, int, int, int]]  # after its last event on each handle


class Checker:
    """Feed stored bodies in global order (`feed`), then `finish` with what the
    database adds (receipts, heads); read `findings`."""

    def __init__(self, manifest_lookup: Callable[[str], bytes | None] | None = None, *,
                 keep: int = KEEP) -> None:
        self.findings: list[Finding] = []
        self.count = 0  # findings, kept or not
        self.keep = keep
        self.states: dict[str, HandleState] = {}
        self.events = 0
        self._next = 1
        self._ids: set[str] = set()
        self._stream_pos: dict[str, int] = {}
        self._last: dict[str, tuple[int, str]] = {}  # stream -> its last (position, event id)
        self._clock: dict[tuple[str, str], int] = {}
        self._ops: dict[str, _Op] = {}
        self._prev_op: str | None = None
        self._e: ev.Event | None = None
        self._line: int | None = None
        self.kv: dict[str, tuple[int, int, int]] = {}  # KV-event stream -> (epoch, next seq, position)
        self._rules = EventRules(self.states, self._find, manifest_lookup)

    # -- input ---------------------------------------------------------------------

    @property
    def full(self) -> bool:
        return self.count >= STOP_AFTER

    def add(self, finding: Finding) -> None:
        self.count += 1
        if len(self.findings) < self.keep:
            self.findings.append(finding)

    def feed(self, body: object, *, line: int | None = None, row: StoredEvent | None = None) -> ev.Event | None:
        """Check one stored body: a file line (`line`) or a database row (`row`, whose
        columns are compared with the body). Returns the decoded event, None if the body
        does not decode. Never raises on bad input: every problem is a finding."""
        self.events += 1
        self._line = line
        at = None if row is None else position_of(row.global_position)
        if not isinstance(body, bytes):
            self.add(Finding(STORED_TYPE_MISMATCH, f"body is stored as {type(body).__name__}, not bytes",
                             at, line=line))
            if not isinstance(body, str):
                self._next = (at if at is not None else self._next) + 1
                return None
            body = body.encode()  # TEXT: its event still folds, so one damaged row is one finding
        try:
            e = decode_event(body)
        except KvLedgerError as exc:
            checked = self._undecodable(body, exc, line, at)
            if checked is None:
                return None
            e = checked
        problem = noncanonical(body, e)
        if problem is not None:
            self._event_finding(e, NON_CANONICAL, f"body {problem}")
        for name in ("event_id", "stream_id", "request_id", "operation_id"):
            # The ids a journal stores (schemas.ids: PostgreSQL text cannot hold NUL): refused
            # here, not by the decoder (which replay runs per event), so import never fails late.
            value = getattr(e, name)
            if value is not None and (problem := id_problem(value)) is not None:
                self._event_finding(e, ErrorCode.MALFORMED_EVENT.value, f"{name} {problem}")
        if row is not None:
            for problem in column_problems(row, e, names(body).schema_version):
                self._event_finding(e, COLUMN_MISMATCH, problem)
        self.check(e)
        return e

    def damaged(self, d: StoredDamage) -> None:
        """A stored record whose bytes are not what was committed (the journal's chain
        and CRCs say so): the finding names the first event concerned."""
        self.add(Finding(TAMPERED, d.message, d.global_position))
        if d.replaces and d.global_position is not None:
            self.events += 1
            self._next = d.global_position + 1

    def _undecodable(self, body: bytes, exc: KvLedgerError, line: int | None,
                     at: int | None) -> ev.Event | None:
        """The finding for a body that does not decode, named by its row's position (or
        whatever of its envelope still reads); a failure that claims a state change is
        checked without the claim, so the fold goes on."""
        known = names(body)
        raw: Any = None  # the body's JSON value, if it decodes
        if known.event_type == "failure":
            try:
                raw = msgspec.json.decode(body)
            except (msgspec.DecodeError, RecursionError):
                raw = None
        payload = raw.get("payload") if isinstance(raw, dict) else None
        if isinstance(payload, dict):
            claimed = [k for k in _STATE_FIELDS if k in payload]
            if claimed:
                # Check the rest of the event as if the claim were absent, so the fold
                # goes on and the finding names exactly this event.
                stripped = {**raw, "payload": {k: v for k, v in payload.items() if k not in claimed}}
                try:
                    e = decode_event(msgspec.json.encode(stripped))
                except KvLedgerError:
                    e = None
                if isinstance(e, ev.FailureEvent):  # its event_type is failure: not None
                    self._event_finding(e, FAILURE_CHANGES_STATE,
                                        f"failure of {e.payload.txn_id} carries {', '.join(claimed)}: "
                                        "a failure publishes nothing and leaves its base visible")
                    return e
        pos = at if at is not None else known.global_position
        self.add(Finding(exc.code.value, exc.message, pos, known.event_id, known.stream_id,
                         known.event_type, line))
        self._next = (pos if pos is not None else self._next) + 1
        if known.stream_id is not None and known.stream_position is not None:
            self._stream_pos[known.stream_id] = known.stream_position
        return None

    # -- one event -----------------------------------------------------------------

    def check(self, e: ev.Event) -> None:
        self._e = e
        self._envelope(e)
        if isinstance(e, ev.KV_EVENT_CLASSES):
            return self._kv(e)  # type: ignore[arg-type]  # narrowed by the tuple
        s = self.states.get(e.stream_id)
        if not self._handle_may_take(s, e) or not self._rules.check(s, e):
            return None
        return self._apply(s, e)

    def _envelope(self, e: ev.Event) -> None:
        """What every event's envelope keeps: its global and stream positions, a unique id,
        its operation contiguous, its source's clock never backwards."""
        pos, sid = e.global_position, e.stream_id
        if pos != self._next:
            self._find(POSITION_GAP, f"global position {pos}, expected {self._next}")
        self._next = pos + 1
        if e.event_id in self._ids:
            self._find(DUPLICATE_EVENT_ID, f"event id {e.event_id} appears twice")
        self._ids.add(e.event_id)
        self._track_op(e)
        expected = self._stream_pos.get(sid, 0) + 1
        if e.stream_position != expected:
            self._find(STREAM_POSITION_GAP, f"stream position {e.stream_position} on {sid}, "
                                            f"expected {expected}")
        self._stream_pos[sid] = e.stream_position
        clock_key = (sid, e.source_instance)
        if e.monotonic_ns < self._clock.get(clock_key, 0):
            self._find(TIME_REGRESSION, f"monotonic_ns {e.monotonic_ns} is before the stream's "
                                        f"previous {self._clock[clock_key]} from {e.source_instance}")
        self._clock[clock_key] = max(e.monotonic_ns, self._clock.get(clock_key, 0))

    def _handle_may_take(self, s: HandleState | None, e: ev.Event) -> bool:
        """Whether `e` may go to its handle (state `s`) at all: one exists unless the event
        creates it, it is not released; its generation and request, checked."""
        sid = e.stream_id
        creates = isinstance(e, (ev.RequestAllocateEvent, ev.ForkEvent))
        if s is None:
            if not creates:
                self._find(UNKNOWN_STREAM, f"{e.event_type} on {sid} before its request_allocate or fork")
            return creates
        if creates:
            self._find("HANDLE_EXISTS", f"{e.event_type} of {sid}, which already exists")
            return False
        if s.lifecycle == "RELEASED":
            self._find(EVENT_AFTER_RELEASE, f"{e.event_type} on {sid} after its release")
            return False
        if e.handle_generation < s.generation:
            self._find(GENERATION_REGRESSION, f"decided against generation {e.handle_generation}; "
                                              f"{sid} is at {s.generation}")
        elif e.handle_generation > s.generation:
            self._find(GENERATION_MISMATCH, f"decided against generation {e.handle_generation}; "
                                            f"{sid} is at {s.generation}")
        if e.request_id != s.request_id:
            self._find(REQUEST_MISMATCH, f"request {e.request_id} on {sid}, which belongs to "
                                         f"{s.request_id}")
        return True

    def _apply(self, s: HandleState | None, e: ev.Event) -> None:
        """Fold `e` into its handle's state, checking what the new state holds."""
        sid = e.stream_id
        try:
            new = evolve(s, e)
        except Exception as exc:  # noqa: BLE001 - the finding is the point
            return self._find("CORRUPT_JOURNAL", f"cannot apply {e.event_type} to {sid}: {exc}")
        # Checked where the committed length moves, so one violation is one finding.
        if s is None or new.committed_length != s.committed_length:
            if new.committed_length > new.logical_length:
                self._find(COMMITTED_EXCEEDS_LOGICAL, f"{sid} commits {new.committed_length} rows but "
                                                      f"holds {new.logical_length} tokens")
            if new.committed_length > new.reserved_capacity:
                self._find(RESERVED_BELOW_COMMITTED, f"{sid} commits {new.committed_length} rows in "
                                                     f"{new.reserved_capacity} reserved slots")
        self.states[sid] = new
        self._last[sid] = (e.global_position, e.event_id)
        if e.operation_id is not None:
            self._ops[e.operation_id].handles[sid] = (new.generation, new.snapshot_version,
                                                      new.stream_position, new.committed_length)
        return None

    def _kv(self, e: ev.KvStreamEvent) -> None:
        """A KV-event stream: seqs 0, 1, 2, ... in each epoch, each exactly once, a gap
        journaled where some never arrived, the epoch +1 at each publisher restart."""
        sid = e.stream_id
        if sid in self.states:
            return self._find(UNKNOWN_STREAM, f"{e.event_type} on {sid}, which is a handle's stream")
        epoch, next_seq, _ = self.kv.get(sid, (0, 0, 0))
        p = e.payload
        if isinstance(p, kv.KvEventsRestart):
            if p.epoch != epoch + 1:
                self._find(KV_EPOCH_ORDER, f"restart of {sid} to epoch {p.epoch}, expected {epoch + 1}")
            if p.previous_seq != next_seq - 1:
                self._find(KV_SEQ_ORDER, f"restart of {sid} says the last seq was {p.previous_seq}, the stream "
                                         f"ends at {next_seq - 1}")
            epoch, next_seq = p.epoch, 0
        else:
            if p.epoch != epoch:
                self._find(KV_EPOCH_ORDER, f"{e.event_type} of {sid} in epoch {p.epoch}, the stream is in {epoch} "
                                           "(a new epoch starts with kv_events_restart)")
            first, last = (p.first_seq, p.last_seq) if isinstance(p, kv.KvEventsGap) else (p.seq, p.seq)
            if last < first:
                self._find(KV_SEQ_ORDER, f"gap of {sid} from {first} to {last}")
            elif first != next_seq:
                what = "again" if first < next_seq else f"after {next_seq - 1} with no gap journaled"
                self._find(KV_SEQ_ORDER, f"seq {first} of {sid} (epoch {p.epoch}) {what}; expected {next_seq}")
            epoch, next_seq = p.epoch, max(next_seq, last + 1)
        if e.handle_generation != epoch:
            self._find(GENERATION_MISMATCH, f"decided against generation {e.handle_generation}; {sid} is at "
                                            f"epoch {epoch}")
        if e.request_id != sid:
            self._find(REQUEST_MISMATCH, f"request {e.request_id} on KV-event stream {sid}")
        self.kv[sid] = (epoch, next_seq, e.stream_position)
        self._last[sid] = (e.global_position, e.event_id)
        if e.operation_id is not None:
            self._ops[e.operation_id].handles[sid] = (epoch, next_seq, e.stream_position, 0)
        return None

    def _track_op(self, e: ev.Event) -> None:
        op_id = e.operation_id
        if op_id is None:
            self._prev_op = None
            return
        op = self._ops.get(op_id)
        if op is None:
            self._ops[op_id] = _Op(e.global_position, e.global_position, [e.event_id], {})
        else:
            if op_id != self._prev_op:
                self._find(OPERATION_NOT_CONTIGUOUS, f"operation {op_id} resumes after other "
                                                     "operations committed")
            op.last = e.global_position
            op.event_ids.append(e.event_id)
        self._prev_op = op_id


    def _find(self, code: str, message: str) -> None:
        assert self._e is not None  # called from check(), which sets it
        self._event_finding(self._e, code, message)

    def _event_finding(self, e: ev.Event, code: str, message: str) -> None:
        self.add(Finding(code, message, e.global_position, e.event_id, e.stream_id, e.event_type,
                         self._line))

    # -- what the database adds ------------------------------------------------------

    def result(self, *, stopped: str | None = None, storage: str | None = None,
               anchor: str | None = None) -> VerifyResult:
        return VerifyResult(self.events, self.findings, self.count - len(self.findings), stopped, storage, anchor)

    def finish(self, receipts: Iterable[Receipt | StoredReceipt] | None = None,
               heads: dict[str, HeadFacts] | None = None) -> list[Finding]:
        if receipts is not None:
            self._check_receipts(receipts)
        if heads is not None:
            self._check_heads(heads)
        return self.findings

    def _check_receipts(self, receipts: Iterable[Receipt | StoredReceipt]) -> None:
        seen: set[str] = set()
        for item in receipts:
            r = self._stored_receipt(item, seen) if isinstance(item, StoredReceipt) else item
            if r is None:
                continue
            seen.add(r.operation_id)
            op = self._ops.get(r.operation_id)
            if op is None:
                self.add(Finding(
                    RECEIPT_MISMATCH, f"receipt {r.operation_id} names no journaled event",
                    r.first_global_position, r.event_ids[0] if r.event_ids else None))
                continue
            handles = {h.handle_id: (h.generation, h.snapshot_version, h.stream_position, h.committed_length)
                       for h in r.handles}
            problems = []
            if tuple(op.event_ids) != tuple(r.event_ids):
                problems.append("event ids")
            if (op.first, op.last) != (r.first_global_position, r.last_global_position):
                problems.append(f"positions [{r.first_global_position}, {r.last_global_position}] "
                                f"vs [{op.first}, {op.last}]")
            if handles != op.handles:
                problems.append("handle results")
            if problems:
                self.add(Finding(RECEIPT_MISMATCH, f"receipt {r.operation_id} differs from its "
                                 f"events: {'; '.join(problems)}", op.first, op.event_ids[0]))
        for op_id, op in self._ops.items():
            if op_id not in seen:
                self.add(Finding(RECEIPT_MISSING, f"operation {op_id} has no receipt",
                                 op.first, op.event_ids[0]))

    def _stored_receipt(self, row: StoredReceipt, seen: set[str]) -> Receipt | None:
        """The receipt a stored row holds (None if its body does not decode), after a
        finding for each column that disagrees with it."""
        r, problems = receipt_problems(row)
        if isinstance(row.operation_id, str):
            seen.add(row.operation_id)  # damaged, not missing
        code = RECEIPT_MISMATCH if r is not None else MALFORMED_RECEIPT
        for problem in problems:
            self.add(Finding(code, f"receipt {short(row.operation_id)}: {problem}",
                             position_of(row.first_global_position)))
        return r

    def _check_heads(self, heads: dict[str, HeadFacts]) -> None:
        for sid, s in self.states.items():
            h = heads.get(sid)
            pos, event_id = self._last.get(sid, (None, None))
            if h is None or h != head_facts(s):
                self.add(Finding(HEAD_MISMATCH, f"head row of {sid} does not match its stream",
                                 pos, event_id, sid))
        for sid, (epoch, next_seq, position) in self.kv.items():
            h = heads.get(sid)
            if h is None or h != kv_head_facts(sid, (epoch, next_seq, position)):
                pos, event_id = self._last[sid]
                self.add(Finding(HEAD_MISMATCH, f"head row of {sid} does not match its stream", pos, event_id, sid))
        for sid in heads:
            if sid not in self.states and sid not in self.kv:
                self.add(Finding(HEAD_MISMATCH, f"head row of {sid}, which has no events",
                                 stream_id=sid))


def verify_bodies(bodies: Iterable[tuple[int | None, bytes]], *,
                  receipts: Iterable[Receipt | StoredReceipt] | None = None, heads: dict[str, HeadFacts] | None = None,
                  manifest_lookup: Callable[[str], bytes | None] | None = None,
                  keep: int = KEEP) -> VerifyResult:
    """Check `(line number, body)` pairs in order, then the receipts and heads given."""
    checker = Checker(manifest_lookup, keep=keep)
    for n, body in bodies:
        checker.feed(body, line=n)
        if checker.full:
            return checker.result(stopped=_stopped(f"line {n}"))
    checker.finish(receipts, heads)
    return checker.result()


def verify_journal(journal: Journal, *, keep: int = KEEP, expect: anchors.Anchor | None = None,
                   key: bytes | None = None) -> VerifyResult:
    """Storage, event rows, receipts, head rows and stored manifests of a journal
    database, all read in one snapshot: a writer committing meanwhile changes nothing.
    With `expect` (an anchor, `kvledger head`), the journal must extend it; with `key`,
    it must be signed with that key."""
    with journal.snapshot() as snap:
        checker = Checker(snap.manifest, keep=keep)
        outcome = None
        if expect is not None:
            problem, outcome = anchors.check(snap, expect, key)
            if problem is not None:
                checker.add(Finding(ANCHOR_MISMATCH, problem, expect.position))
        integrity = snap.integrity()
        for problem in integrity.problems:
            checker.add(Finding(STORAGE_CORRUPT, f"{integrity.checked}: {problem}"))
        storage = integrity.checked + (f" (skipped: {integrity.skipped})" if integrity.skipped else "")
        try:
            for row in snap.events():
                if isinstance(row, StoredDamage):
                    checker.damaged(row)
                else:
                    checker.feed(row.body, row=row)
                if checker.full:
                    return checker.result(stopped=_stopped(f"position {row.global_position!r}"),
                                          storage=storage, anchor=outcome)
            checker.finish(snap.receipts(), snap.heads())
        except KvLedgerError as exc:
            if not integrity.problems:
                raise  # a database that says it is whole but cannot be read: not a finding
            checker.add(Finding(STORAGE_CORRUPT, f"reading stopped after {checker.events} events: "
                                                 f"{exc.message}"))
    return checker.result(storage=storage, anchor=outcome)


def verify_jsonl(path: str | Path, *, keep: int = KEEP) -> VerifyResult:
    """An audit file: the events alone (no receipts or heads to compare), read line by
    line. A line too long to be an event ends the reading: no next line can be found
    within the bound (think of /dev/zero)."""
    checker = Checker(keep=keep)
    lines = jsonl_bodies(path)  # opens now: an unreadable path is an error, not a finding
    try:
        for n, body in lines:
            checker.feed(body, line=n)
            if checker.full:
                return checker.result(stopped=_stopped(f"line {n}"))
    except KvLedgerError as exc:
        if exc.code is not ErrorCode.FIELD_TOO_LARGE:
            raise
        line = exc.details.get("line")
        checker.add(Finding(exc.code.value, exc.message, line=line if isinstance(line, int) else None))
        return checker.result(stopped=f"{exc.message}: no next line can be found within the bound")
    return checker.result()


def _stopped(where: str) -> str:
    return f"stopped at {where} after {STOP_AFTER} findings; the rest was not read"
