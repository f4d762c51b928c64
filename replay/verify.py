"""verify: every invariant of the journal, checked over the whole event sequence.

A pure checker. It reads stored bodies (so an undecodable line is a finding, not a
crash), folds each stream with the same `engine.evolve` the service uses, and before
applying an event checks that the event is one `decide` could have produced from the
state so far. Each finding names the event it points to. An event that cannot be
applied (a publish of a transaction that never started, anything after release) is
reported and skipped, so one bad line does not hide the rest of the journal.

Codes reuse schemas.errors names where the invariant is the same rule the command
path enforces (STALE_BASE, APPEND_HOLE, ABI_MISMATCH, ...); the others are below.

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

from kvledger.engine.evolve import cut, evolve
from kvledger.engine.heads import head as head_facts  # the head row exactly as the service writes it
from kvledger.engine.state import HandleState
from kvledger.journal.contract import HeadFacts, StoredDamage, StoredEvent, StoredReceipt
from kvledger.journal.port import Journal
from kvledger.replay import anchor as anchors
from kvledger.replay.kv_blocks import kv_head_facts
from kvledger.replay.sources import jsonl_bodies
from kvledger.replay.stored import column_problems, names, position_of, receipt_problems, short
from kvledger.schemas import events as ev
from kvledger.schemas import kv_events as kv
from kvledger.schemas.canonical import canonical_json, sha256_hex
from kvledger.schemas.codec import decode_event, noncanonical
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.manifest import (
    b_token,
    cache_abi_sha256,
    manifest_sha256,
    prefix_identity_sha256,
    validate_manifest,
)
from kvledger.schemas.receipts import Receipt

# Verify-only codes (the rest are schemas.errors.ErrorCode values).
TAMPERED = "TAMPERED"  # a stored record is not what was committed (chain, CRC, positions, lookup rows)
POSITION_GAP = "POSITION_GAP"  # global positions not 1, 2, 3, ...
STREAM_POSITION_GAP = "STREAM_POSITION_GAP"
DUPLICATE_EVENT_ID = "DUPLICATE_EVENT_ID"
OPERATION_NOT_CONTIGUOUS = "OPERATION_NOT_CONTIGUOUS"  # one commit = consecutive positions
UNKNOWN_STREAM = "UNKNOWN_STREAM"  # an event before its stream's allocate or fork
PUBLISH_WITHOUT_START = "PUBLISH_WITHOUT_START"
DUPLICATE_TXN = "DUPLICATE_TXN"
FAILURE_WITHOUT_START = "FAILURE_WITHOUT_START"
FAILURE_CHANGES_STATE = "FAILURE_CHANGES_STATE"  # a failure must leave its base visible
COMMITTED_LENGTH_MISMATCH = "COMMITTED_LENGTH_MISMATCH"
COMMITTED_EXCEEDS_LOGICAL = "COMMITTED_EXCEEDS_LOGICAL"
VISIBLE_BEYOND_COMMITTED = "VISIBLE_BEYOND_COMMITTED"
RESERVED_BELOW_COMMITTED = "RESERVED_BELOW_COMMITTED"
RECLAIMABLE_EXCEEDS_RESIDENT = "RECLAIMABLE_EXCEEDS_RESIDENT"
RELEASE_LENGTH_MISMATCH = "RELEASE_LENGTH_MISMATCH"
GENERATION_REGRESSION = "GENERATION_REGRESSION"
GENERATION_MISMATCH = "GENERATION_MISMATCH"
SNAPSHOT_DISCONTINUITY = "SNAPSHOT_DISCONTINUITY"
EVENT_AFTER_RELEASE = "EVENT_AFTER_RELEASE"
WORK_AFTER_FINISH = "WORK_AFTER_FINISH"
OPEN_TXN_AT_CLOSE = "OPEN_TXN_AT_CLOSE"
OUTPUT_INDEX_GAP = "OUTPUT_INDEX_GAP"
COUNT_MISMATCH = "COUNT_MISMATCH"  # finish/truncate counters vs the fold
REQUEST_MISMATCH = "REQUEST_MISMATCH"
REORDER_MISMATCH = "REORDER_MISMATCH"
B_TOKEN_MISMATCH = "B_TOKEN_MISMATCH"
TIME_REGRESSION = "TIME_REGRESSION"  # one source's monotonic clock ran backwards
RECEIPT_MISMATCH = "RECEIPT_MISMATCH"
RECEIPT_MISSING = "RECEIPT_MISSING"
HEAD_MISMATCH = "HEAD_MISMATCH"
MANIFEST_MISSING = "MANIFEST_MISSING"
COLUMN_MISMATCH = "COLUMN_MISMATCH"  # an indexed column disagrees with the row's body
STORED_TYPE_MISMATCH = "STORED_TYPE_MISMATCH"  # e.g. a body stored as TEXT, not bytes
MALFORMED_RECEIPT = "MALFORMED_RECEIPT"  # a receipt body that does not decode
STORAGE_CORRUPT = "STORAGE_CORRUPT"  # the database's own integrity check failed
KV_SEQ_ORDER = "KV_SEQ_ORDER"  # a KV-event stream's seqs not 0, 1, 2, ... in each epoch (gaps journaled)
KV_EPOCH_ORDER = "KV_EPOCH_ORDER"  # a KV-event stream's epoch not 0, then +1 at each restart
ANCHOR_MISMATCH = "ANCHOR_MISMATCH"  # the journal does not extend the anchor given (verify --expect)
NON_CANONICAL = ErrorCode.NON_CANONICAL_EVENT.value

KEEP = 100  # findings kept for the report; the rest are counted
STOP_AFTER = 10_000  # findings after which verify stops reading

# Payload fields only a state-changing event carries: on a failure they claim a change.
_STATE_FIELDS = ("result_snapshot_version", "committed_length", "accepted_count", "layers", "layers_complete",
                 "new_length", "result_generation", "released_length")


class Finding(msgspec.Struct, frozen=True, omit_defaults=True):
    code: str
    message: str
    global_position: int | None = None
    event_id: str | None = None
    stream_id: str | None = None
    event_type: str | None = None
    line: int | None = None


class VerifyResult(msgspec.Struct, frozen=True):
    events: int
    findings: list[Finding]  # the first ones (Checker's `keep`)
    omitted: int = 0  # findings counted beyond those
    stopped: str | None = None  # why reading stopped early, if it did
    storage: str | None = None  # the database storage check that ran, or why it was skipped
    anchor: str | None = None  # with an expected anchor: what the check found

    @property
    def ok(self) -> bool:
        return not self.findings and not self.omitted and self.stopped is None


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
        self._manifest_lookup = manifest_lookup
        self._next = 1
        self._ids: set[str] = set()
        self._stream_pos: dict[str, int] = {}
        self._txns: dict[str, set[str]] = {}
        self._last: dict[str, tuple[int, str]] = {}  # stream -> its last (position, event id)
        self._clock: dict[tuple[str, str], int] = {}
        self._ops: dict[str, _Op] = {}
        self._prev_op: str | None = None
        self._e: ev.Event | None = None
        self._line: int | None = None
        self.kv: dict[str, tuple[int, int, int]] = {}  # KV-event stream -> (epoch, next seq, position)

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
            # These become text columns, and PostgreSQL text cannot hold NUL: refused here
            # (not by the decoder, which replay runs per event) so import never fails late.
            if "\x00" in (getattr(e, name) or ""):
                self._event_finding(e, ErrorCode.MALFORMED_EVENT.value, f"{name} contains a NUL character")
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

        if isinstance(e, ev.KV_EVENT_CLASSES):
            return self._kv(e)  # type: ignore[arg-type]  # narrowed by the tuple
        s = self.states.get(sid)
        creates = isinstance(e, (ev.RequestAllocateEvent, ev.ForkEvent))
        if s is None and not creates:
            return self._find(UNKNOWN_STREAM, f"{e.event_type} on {sid} before its request_allocate or fork")
        if s is not None and creates:
            return self._find("HANDLE_EXISTS", f"{e.event_type} of {sid}, which already exists")
        if s is not None:
            if s.lifecycle == "RELEASED":
                return self._find(EVENT_AFTER_RELEASE, f"{e.event_type} on {sid} after its release")
            if e.handle_generation < s.generation:
                self._find(GENERATION_REGRESSION, f"decided against generation {e.handle_generation}; "
                                                  f"{sid} is at {s.generation}")
            elif e.handle_generation > s.generation:
                self._find(GENERATION_MISMATCH, f"decided against generation {e.handle_generation}; "
                                                f"{sid} is at {s.generation}")
            if e.request_id != s.request_id:
                self._find(REQUEST_MISMATCH, f"request {e.request_id} on {sid}, which belongs to "
                                             f"{s.request_id}")
        if not _CHECKS[type(e)](self, s, e):
            return None
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
        self._last[sid] = (pos, e.event_id)
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

    # -- per event type: return False when the event must not be applied -----------

    def _allocate(self, s: None, e: ev.RequestAllocateEvent) -> bool:
        p, m = e.payload, e.payload.manifest
        try:
            validate_manifest(m)
        except KvLedgerError as exc:
            self._find(exc.code.value, exc.message)
        for name, want, got in (("manifest_sha256", manifest_sha256(m), p.manifest_sha256),
                                ("cache_abi_sha256", cache_abi_sha256(m), p.cache_abi_sha256),
                                ("prefix_identity_sha256", prefix_identity_sha256(m),
                                 p.prefix_identity_sha256)):
            if want != got:
                self._find("DIGEST_MISMATCH", f"{name} {got[:12]} does not match the manifest ({want[:12]})")
        if b_token(m.cache_schema) != p.b_token:
            self._find(B_TOKEN_MISMATCH, f"b_token {p.b_token}, the cache schema gives "
                                         f"{b_token(m.cache_schema)}")
        if e.request_id != m.request_identity.request_id:
            self._find(REQUEST_MISMATCH, f"request {e.request_id}, manifest names "
                                         f"{m.request_identity.request_id}")
        if self._manifest_lookup is not None:
            stored = self._manifest_lookup(p.manifest_sha256)
            if stored is None:
                self._find(MANIFEST_MISSING, f"manifest {p.manifest_sha256[:12]} is not stored")
            elif (not isinstance(stored, bytes) or sha256_hex(stored) != p.manifest_sha256
                  or stored != canonical_json(m)):
                self._find("DIGEST_MISMATCH", f"stored manifest {p.manifest_sha256[:12]} does not match "
                                              "its digest or the event's manifest")
        return True

    def _fork(self, s: None, e: ev.ForkEvent) -> bool:
        p = e.payload
        parent = self.states.get(p.parent_handle_id)
        if parent is None:
            self._find(UNKNOWN_STREAM, f"fork from unknown parent {p.parent_handle_id}")
            return True
        if parent.lifecycle == "RELEASED":
            self._find(EVENT_AFTER_RELEASE, f"fork from {p.parent_handle_id} after its release")
        if (p.parent_generation, p.parent_snapshot_version) != (parent.generation, parent.snapshot_version):
            self._find("STALE_BASE", f"fork names parent ({p.parent_generation}, "
                                     f"{p.parent_snapshot_version}), "
                                     f"parent is at ({parent.generation}, {parent.snapshot_version})")
        if p.prefix_length > parent.committed_length:
            self._find(VISIBLE_BEYOND_COMMITTED, f"fork at {p.prefix_length}, parent committed "
                                                 f"{parent.committed_length}")
        elif (p.token_ids != parent.prompt + cut(parent, p.prefix_length)["outputs"]
              or p.prompt_length != len(parent.prompt)):
            self._find("FRONTIER_MISMATCH", "fork tokens differ from the parent's at the cut")
        for name in ("manifest_sha256", "cache_abi_sha256", "prefix_identity_sha256"):
            if getattr(p, name) != getattr(parent, name):
                self._find("DIGEST_MISMATCH", f"fork {name} differs from the parent's")
        if (p.b_token, p.num_layers) != (parent.b_token, parent.num_layers):
            self._find(B_TOKEN_MISMATCH, "fork b_token or layer count differs from the parent's")
        return True

    def _start(self, s: HandleState, e: ev.AppendStartEvent) -> bool:
        p = e.payload
        t, n = p.interval_start, p.interval_count
        seen = self._txns.setdefault(e.stream_id, set())
        if p.txn_id in seen:
            self._find(DUPLICATE_TXN, f"transaction {p.txn_id} started twice on {e.stream_id}")
        seen.add(p.txn_id)
        if p.cache_abi_sha256 != s.cache_abi_sha256:
            self._find("ABI_MISMATCH", f"rows for ABI {p.cache_abi_sha256[:12]}, handle has "
                                       f"{s.cache_abi_sha256[:12]}")
        self._active(s, e, allow_finished=p.kind == "repair")
        if p.base_snapshot_version != s.snapshot_version:
            self._find("STALE_BASE", f"started at snapshot {p.base_snapshot_version}, handle is at "
                                     f"{s.snapshot_version}")
        if t > s.committed_length:
            self._find("APPEND_HOLE", f"interval starts at {t}, committed length is {s.committed_length}")
        elif t < s.committed_length:
            self._find("POSITION_MASK_MISMATCH", f"interval starts at {t}, inside committed "
                                                 f"[0, {s.committed_length})")
        if len(p.token_ids) != n or p.cache_positions != tuple(range(t, t + n)):
            self._find("POSITION_MASK_MISMATCH", f"token ids or cache positions do not cover [{t}, {t + n})")
        if p.mask_key_extent > t + n:
            self._find(VISIBLE_BEYOND_COMMITTED, f"mask key extent {p.mask_key_extent} sees past the "
                                                 f"committed rows and this call's [{t}, {t + n})")
        elif p.mask_key_extent < t + n:
            self._find("POSITION_MASK_MISMATCH", f"mask key extent {p.mask_key_extent} < {t + n}")
        if t + n > s.reserved_capacity:
            self._find("CAPACITY_EXCEEDED", f"[{t}, {t + n}) exceeds reserved capacity {s.reserved_capacity}")
        if p.kind == "verify":
            if t != s.logical_length:
                self._find("FRONTIER_MISMATCH", f"verify drafts start at {t}, the request holds "
                                                f"{s.logical_length} tokens")
        elif p.token_ids != s.logical_tokens(t, t + n) or t + n > s.logical_length:
            self._find("FRONTIER_MISMATCH", f"token ids differ from the request's tokens at [{t}, {t + n})")
        return True

    def _publish(self, s: HandleState, e: ev.AppendPublishEvent) -> bool:
        p = e.payload
        txn = s.open_txn(p.txn_id)
        if txn is None:
            if p.txn_id in s.aborted_txn_ids:
                self._find("TXN_ABORTED", f"publish of {p.txn_id} after its failure")
            else:
                self._find(PUBLISH_WITHOUT_START, f"publish of {p.txn_id}, which no append_start opened")
            return False
        self._active(s, e, allow_finished=txn.kind == "repair")
        if p.base_snapshot_version != s.snapshot_version or txn.base_snapshot_version != s.snapshot_version:
            self._find("STALE_BASE", f"publish from snapshot {p.base_snapshot_version} (started at "
                                     f"{txn.base_snapshot_version}); handle is at {s.snapshot_version}")
        if p.result_snapshot_version != p.base_snapshot_version + 1:
            self._find(SNAPSHOT_DISCONTINUITY,
                       f"snapshot {p.base_snapshot_version} -> {p.result_snapshot_version}")
        accepted = p.accepted_count
        if accepted > txn.interval_count:
            self._find("REJECTED_SUFFIX", f"accepts {accepted} of {txn.interval_count} staged rows")
        elif txn.kind != "verify" and accepted != txn.interval_count:
            self._find(COMMITTED_LENGTH_MISMATCH,
                       f"{txn.kind} commits {accepted} of {txn.interval_count} staged rows")
        if p.layers_complete != s.num_layers:
            self._find("PARTIAL_LAYER_SET", f"{p.layers_complete} layers with complete K and V over the "
                                            f"published rows != all {s.num_layers}")
        if p.committed_length != txn.interval_start + accepted:
            self._find(COMMITTED_LENGTH_MISMATCH, f"committed length {p.committed_length} != "
                                                  f"{txn.interval_start} + {accepted} accepted")
        return True

    def _failure(self, s: HandleState, e: ev.FailureEvent) -> bool:
        p = e.payload
        txn = s.open_txn(p.txn_id)
        if txn is None:
            self._find(FAILURE_WITHOUT_START, f"failure of {p.txn_id}, which is not open")
            return False
        if p.base_snapshot_version != txn.base_snapshot_version:
            self._find(FAILURE_CHANGES_STATE, f"failure claims base {p.base_snapshot_version}; "
                                              f"{p.txn_id} started at {txn.base_snapshot_version}")
        return True

    def _emit(self, s: HandleState, e: ev.OutputEmitEvent) -> bool:
        p = e.payload
        self._active(s, e)
        if p.snapshot_version > s.snapshot_version:
            self._find(VISIBLE_BEYOND_COMMITTED, f"output from snapshot {p.snapshot_version}; newest "
                                                 f"published is {s.snapshot_version}")
        elif p.snapshot_version < s.snapshot_version:
            self._find("STALE_BASE", f"output from snapshot {p.snapshot_version}, handle is at "
                                     f"{s.snapshot_version}")
        elif not s.logits_ready:
            self._find("OUTPUT_NOT_READY", "output without logits of a published call")
        if p.output_index != len(s.outputs):
            self._find(OUTPUT_INDEX_GAP, f"output index {p.output_index}, next is {len(s.outputs)}")
        return True

    def _truncate(self, s: HandleState, e: ev.TruncateEvent) -> bool:
        p = e.payload
        self._active(s, e)
        self._snapshot_step(s, p.base_snapshot_version, p.result_snapshot_version)
        if p.new_length > s.committed_length:
            self._find("TRUNCATE_GROWS", f"truncate to {p.new_length} > committed {s.committed_length}")
        elif p.output_count != len(cut(s, p.new_length)["outputs"]):
            self._find(COUNT_MISMATCH, f"truncate keeps {p.output_count} outputs")
        return True

    def _reorder(self, s: HandleState, e: ev.ReorderEvent) -> bool:
        p = e.payload
        self._active(s, e)
        n = len(p.rows)
        if sorted(p.permutation) != list(range(n)) or len(set(p.rows)) != n:
            self._find("NOT_A_PERMUTATION", f"{list(p.permutation)} over {n} rows")
        elif e.stream_id not in p.rows or p.row_index != p.permutation.index(p.rows.index(e.stream_id)):
            self._find(REORDER_MISMATCH, f"row index {p.row_index} does not follow the permutation")
        return True

    def _cancel(self, s: HandleState, e: ev.CancelRequestEvent) -> bool:
        self._active(s, e)
        self._snapshot_step(s, e.payload.base_snapshot_version, e.payload.result_snapshot_version)
        self._no_open(s)
        return True

    def _finish(self, s: HandleState, e: ev.FinishEvent) -> bool:
        p = e.payload
        self._active(s, e)
        if (p.output_count, p.committed_length) != (len(s.outputs), s.committed_length):
            self._find(COUNT_MISMATCH, f"finish records {p.output_count} outputs / "
                                       f"{p.committed_length} rows; "
                                       f"the fold has {len(s.outputs)} / {s.committed_length}")
        self._no_open(s)
        return True

    def _release(self, s: HandleState, e: ev.ReleaseEvent) -> bool:
        p = e.payload
        if s.lifecycle == "ACTIVE":
            self._find("RELEASE_BEFORE_FINISH", f"release of {e.stream_id} before finish or cancel")
        self._snapshot_step(s, p.base_snapshot_version, p.result_snapshot_version)
        if p.result_generation <= s.generation:
            self._find(GENERATION_REGRESSION,
                       f"release moves generation {s.generation} -> {p.result_generation}")
        if p.released_length > s.committed_length:
            self._find(RECLAIMABLE_EXCEEDS_RESIDENT, f"releases {p.released_length} rows; "
                                                     f"{s.committed_length} are resident")
        elif p.released_length < s.committed_length:
            self._find(RELEASE_LENGTH_MISMATCH, f"releases {p.released_length} of {s.committed_length} rows")
        self._no_open(s)
        return True

    # -- shared ----------------------------------------------------------------------

    def _active(self, s: HandleState, e: ev.Event, *, allow_finished: bool = False) -> None:
        if s.lifecycle == "CANCELLED" or (s.lifecycle == "FINISHED" and not allow_finished):
            self._find(WORK_AFTER_FINISH, f"{e.event_type} on {e.stream_id}, which is {s.lifecycle.lower()}")

    def _snapshot_step(self, s: HandleState, base: int, result: int) -> None:
        if base != s.snapshot_version:
            self._find("STALE_BASE", f"base snapshot {base}, handle is at {s.snapshot_version}")
        if result != base + 1:
            self._find(SNAPSHOT_DISCONTINUITY, f"snapshot {base} -> {result}")

    def _no_open(self, s: HandleState) -> None:
        if s.open_txns:
            self._find(OPEN_TXN_AT_CLOSE, f"transactions {[t.txn_id for t in s.open_txns]} still open: "
                                          "each must end in a publish or a failure first")

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


# Keyed by the event's class: each check takes an event of that class (Any: the dispatch
# pairs them) and its handle's state (None only for an allocate).
_CHECKS: dict[type[ev.Event], Callable[[Checker, Any, Any], bool]] = {
    ev.RequestAllocateEvent: Checker._allocate,
    ev.ForkEvent: Checker._fork,
    ev.AppendStartEvent: Checker._start,
    ev.AppendPublishEvent: Checker._publish,
    ev.FailureEvent: Checker._failure,
    ev.OutputEmitEvent: Checker._emit,
    ev.TruncateEvent: Checker._truncate,
    ev.ReorderEvent: Checker._reorder,
    ev.CancelRequestEvent: Checker._cancel,
    ev.FinishEvent: Checker._finish,
    ev.ReleaseEvent: Checker._release,
}


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
