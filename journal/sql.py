"""The SQL journal: one implementation of the contract for SQLite and PostgreSQL.

The algorithm lives here; journal.sqlite and journal.postgres supply the few
statements whose best form differs (per-row statements in-process vs. one set-based
statement per batch over the network). All SQL uses bound parameters.

One transaction per `append` call:
  1. take the writer lock and read the last global position (gapless, commit-ordered);
  2. look up receipts: a retry returns its original receipt, a changed retry is CONFLICT;
  3. guarded head updates, per round of operations on disjoint handles; an operation
     with a failed guard writes nothing (savepoint when an operation spans handles);
  4. insert events with their global positions, receipts and manifests;
  5. commit. Nothing is acknowledged before the commit returns.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from functools import partial
from typing import Any

import msgspec
from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Engine
from sqlalchemy.pool import NullPool, StaticPool

from kvledger.journal import faults, tuning
from kvledger.journal.contract import (
    Guard,
    HeadFacts,
    ImportTables,
    Operation,
    Rejection,
    StreamWrite,
    guard_of,
)
from kvledger.journal.driver_errors import is_driver_error, release, translate
from kvledger.journal.faults import fault
from kvledger.journal.port import Journal, Snapshot
from kvledger.journal.records import (
    EVENTS_FORMAT,
    FORMAT,
    PREV_NONE,
    compact_parts,
    counted_keys,
    encode_record,
    id_keys,
    id_runs,
    manifest_ref,
    pack_manifest,
    pack_prev,
)
from kvledger.journal.records import chain as link
from kvledger.journal.statements import EventRow, RecordRow, Statements, T
from kvledger.journal.steps import VERSIONS as STEP_VERSIONS
from kvledger.journal.steps import FoldItem, Row, StepWriter
from kvledger.journal.tables import (
    JOURNAL_TABLES,
    REVISIONS,
    SCHEMA_REVISION,
    VERSION_TABLE,
    too_new,
)
from kvledger.journal.url import parse_url, redact
from kvledger.schemas.codec import MAX_EVENT_BYTES, encode_event
from kvledger.schemas.decode_fingerprint import DECODE_CHAIN
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import CURRENT_VERSION, Event, RequestAllocate
from kvledger.schemas.receipts import (
    HandleResult,
    Receipt,
    receipt_decoder,
    receipt_encoder,
)

READ_PAGE = 5000
IMPORT_PAGE_BYTES = 16 << 20  # an import inserts events in pages of at most this many body bytes


def make_engine(url: URL) -> Engine:
    if url.drivername.startswith("sqlite"):
        memory = url.database in (None, "", ":memory:")
        engine = create_engine(
            url,
            poolclass=StaticPool if memory else NullPool,
            connect_args={"check_same_thread": False, "timeout": 60},
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    from kvledger.journal.postgres import polling_connect

    engine = create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": 5})
    event.listen(engine, "do_connect", polling_connect)
    return engine


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    # Takes effect on a new file only (an existing one keeps its pages). The journal is
    # compressed records in overflow chains and small index rows: 1 KB pages leave a
    # quarter of the slack 4 KB ones do: 264 against 308 bytes a decoded token, for about
    # 8% of the write rate and no measured replay cost (docs/COMPACT.md, step 5). Before
    # WAL: WAL fixes the page size.
    cur.execute("PRAGMA page_size=1024")
    # WAL lets readers run beside the writer; FULL fsyncs the WAL at every commit, which
    # is what makes an acknowledged commit survive power loss (kill -9 alone can't tell).
    _retry_busy(lambda: cur.execute("PRAGMA journal_mode=WAL"))
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute("PRAGMA busy_timeout=60000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _retry_busy(fn: Callable[[], Any], seconds: float = 60.0) -> Any:
    """Switching a new file to WAL needs an exclusive lock, and SQLite refuses it at once
    (SQLITE_BUSY without calling the busy handler) while another process is opening the
    same new file: retry for as long as the busy timeout would have waited."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return fn()
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF not in (5, 6) or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def open_journal(raw_url: str) -> SqlJournal:
    """Open a migrated journal. An un-migrated database is NOT_MIGRATED (run `kvledger init`)."""
    url = parse_url(raw_url)
    return SqlJournal(url)


class _ConnectionLock:
    """The lock of the journal's one connection: reentrant, as the journal's own methods
    nest. Between append_deferred and its wait the connection is mid-COMMIT on the
    committer thread while the caller's thread still holds this lock, so an entry by that
    thread (a worker's on_step reading the journal while its next batch is built) first
    waits for the COMMIT to finish; it never shares the connection with it. Other
    threads wait for the release, as with any lock."""

    __slots__ = ("_lock", "committing")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.committing: Future[Any] | None = None  # the deferred COMMIT in flight, if any

    def acquire(self) -> None:
        self._lock.acquire()
        committing = self.committing
        if committing is not None:
            wait_for((committing,))  # its outcome is the deferred wait's to report

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class SqlJournal(Journal):
    def __init__(self, url: URL) -> None:
        self.url = url
        self.display_url = redact(url)
        self.dialect = url.get_backend_name()
        backend: type[Statements]
        if self.dialect == "sqlite":
            from kvledger.journal.sqlite import SqliteStatements as backend
        else:
            from kvledger.journal.postgres import PostgresStatements as backend
        self._proxy = None
        self._pid = os.getpid()
        self._lock = _ConnectionLock()
        self._committer: ThreadPoolExecutor | None = None  # append_deferred's COMMIT thread
        # The single-statement append (see _append_speculative): the last global position
        # this connection committed, and a back-off after mispredictions.
        self._predicted: int | None = None
        self._committed = 0
        # ... and the chain digest of the last record it committed (what the next links to)
        self._predicted_chain = self._committed_chain = b""
        self._misses = 0
        self._skip = 0
        # handle -> (stream position, the committed record holding that event): a record
        # names the one before it on each stream (stream_prev); when an operation's guard
        # expects that position, this is its head's last record (positions never repeat),
        # so the single-statement append needs no read. Only committed records go in.
        self._tails: dict[str, tuple[int, int]] = {}
        self._uncommitted: dict[str, tuple[int, int]] = {}
        try:
            self.engine = make_engine(url)
            self._proxy = self.engine.raw_connection()
            conn = self._proxy.driver_connection
            assert conn is not None  # None only once the pool invalidates the connection
            self.conn = conn
            self.sql = backend(self.conn)
            revision = self.sql.schema_revision(VERSION_TABLE)
            tables = self.sql.existing_tables(JOURNAL_TABLES) if revision is None else None
        except Exception as exc:
            self.close()
            if not is_driver_error(exc):
                raise
            raise translate(exc, url) from None
        if revision != SCHEMA_REVISION:
            self.close()
            if revision is not None and revision not in REVISIONS:
                raise too_new(revision, self.display_url)
            if revision is None and tables:
                state = ("journal tables but no recorded revision (its version table was emptied "
                         "or dropped); run `kvledger init --db URL` to check the tables and record "
                         "their revision")
            else:
                state = (f"{f'revision {revision}' if revision else 'no kvledger tables'}; run "
                         f"`kvledger init --db URL` to migrate it to {SCHEMA_REVISION}")
            raise KvLedgerError(ErrorCode.NOT_MIGRATED, f"{self.display_url} has {state}",
                                revision=revision, journal_tables=sorted(tables or ()))
        # Records of decode steps are packed and read with numpy (journal.blocks). Its import
        # (~0.15 s on this VM) belongs to opening the journal, not to the first commit of
        # decode steps, which a serving loop waits on.
        from kvledger.journal import blocks  # noqa: F401  # imported for its side effect: numpy loaded

    # -- writing -----------------------------------------------------------------

    def append(self, operations: Sequence[Operation]) -> list[Receipt | Rejection]:
        if not operations:
            return []
        for op in operations:
            _validate(op)
        self._check_process()
        with self._lock:
            if faults.INTENTS:
                faults.intend([op.operation_id for op in operations])
            try:
                if self.sql.speculative and self._predicted is not None:
                    fast = self._append_speculative(operations)
                    if fast is not None:
                        fault("after_commit")
                        return fast
                results = self.sql.transaction(lambda cur: self._append(cur, operations))
                self._predicted, self._predicted_chain = self._committed, self._committed_chain
                self._remember()
                fault("after_commit")
                return results
            except KvLedgerError:
                self._predicted = None
                raise
            except Exception as exc:  # noqa: BLE001 - any driver failure becomes a coded error (_driver_error)
                self._predicted = None
                raise self._driver_error(exc) from None

    def append_deferred(self, operations: Sequence[Operation]) -> Callable[[], list[Receipt | Rejection]]:
        """The statements run in the caller's thread; COMMIT, an fsync under
        synchronous=FULL, runs on a committer thread, where the driver releases the GIL,
        so the caller's next model call overlaps it. The writer lock is held until the
        returned function has seen the commit finish. Backends whose commit is not split
        out commit at once."""
        if not operations or not self.sql.deferred_commit:
            return super().append_deferred(operations)
        for op in operations:
            _validate(op)
        self._check_process()
        self._lock.acquire()
        if faults.INTENTS:
            faults.intend([op.operation_id for op in operations])
        try:
            cur = self.sql.begin()
            try:
                results = self._append(cur, operations)
            except BaseException:
                self.sql.end(cur, False)
                raise
        except Exception as exc:  # noqa: BLE001 - any driver failure becomes a coded error (_driver_error)
            self._lock.release()
            raise self._driver_error(exc) from None
        except BaseException:
            self._lock.release()
            raise
        if self._committer is None:
            self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvledger-commit",
                                                 initializer=tuning.pin_writer)
        committed = self._lock.committing = self._committer.submit(self.sql.end, cur, True)
        waited = False

        def wait() -> list[Receipt | Rejection]:
            nonlocal waited
            if waited:
                return results
            waited = True
            try:
                committed.result()
                self._remember()
            except Exception as exc:  # noqa: BLE001 - a failed COMMIT acknowledges nothing
                with contextlib.suppress(Exception):
                    self.conn.execute("ROLLBACK")
                raise self._driver_error(exc) from None
            finally:
                self._lock.committing = None
                self._lock.release()
            try:
                fault("after_commit")
            except Exception as exc:  # noqa: BLE001 - as append: an outcome the caller cannot know
                raise self._driver_error(exc) from None
            return results

        return wait

    def _append_speculative(self, ops: Sequence[Operation]) -> list[Receipt | Rejection] | None:
        """The common case in one round trip: every operation writes one existing handle,
        handles and operation ids are distinct, and this connection knows the last global
        position. The backend commits all of it only if, under the writer lock, every guard
        held, no receipt exists and the last position is the predicted one; otherwise it
        rolls back and returns False, and the general path decides (None here)."""
        if self._skip:
            self._skip -= 1
            return None
        handles: set[str] = set()
        op_ids: set[str] = set()
        updates: list[tuple[StreamWrite, Guard]] = []
        prevs: dict[str, int] = {}
        for op in ops:
            if len(op.writes) != 1 or op.checks or op.manifests:
                return None
            w = op.writes[0]
            if w.expected is None:
                return None
            tail = self._tails.get(w.handle_id)
            if tail is None or tail[0] != w.expected.stream_position:
                return None  # its last record is not known here: the general path reads it
            prevs[w.handle_id] = tail[1]
            handles.add(w.handle_id)
            op_ids.add(op.operation_id)
            updates.append((w, w.expected))
        if len(handles) != len(ops) or len(op_ids) != len(ops):
            return None
        last = self._predicted
        assert last is not None
        results: list[Receipt | Rejection | None] = [None] * len(ops)
        record, _, position = self._rows(ops, range(len(ops)), results, last, self._predicted_chain, set(), prevs)
        assert record is not None  # every operation writes an event
        fault("before_update")
        event_ids = [e for r in results if isinstance(r, Receipt) for e in r.event_ids]  # _rows made each
        if self.sql.append_if(updates, record, list(op_ids), event_ids, last):
            self._predicted, self._predicted_chain, self._misses = position, record[2], 0
            self._remember()
            return results  # type: ignore[return-value]  # _rows filled every slot
        # Another writer moved the journal (or a guard failed, or this is a retry): back
        # off exponentially so a contended journal does not pay a wasted round trip each time.
        self._misses = min(self._misses + 1, 6)
        self._skip = (1 << self._misses) - 1
        return None

    def _append(self, cur: Any, ops: Sequence[Operation]) -> list[Receipt | Rejection]:
        # One pass per step, no per-event helper calls: this loop is the Python cost a
        # publication pays on top of the database's (see docs/PERFORMANCE.md).
        op_ids = list({op.operation_id: None for op in ops})
        event_ids: list[str] = []
        keys: dict[str, int] = {}  # computed once: the lookup's and the record's
        owned = [op.event_ids() for op in ops]  # and each operation's ids, for _rows too
        for op, own in zip(ops, owned):
            event_ids += own
            if (x := op.step) is not None:  # its ids' keys from their counters, not their text
                keys.update(zip((op.operation_id, *own), counted_keys(x.prefix, x.counters())))
        rest = [i for i in op_ids + event_ids if i not in keys] if keys else op_ids + event_ids
        keys.update(zip(rest, id_keys(rest)))
        runs = id_runs(keys.values())  # the lookup's, and the record's if it holds every id
        last, chain, stored, taken = self.sql.begin_append(cur, op_ids, event_ids, runs)
        results: list[Receipt | Rejection | None] = [None] * len(ops)
        first_in_batch: dict[str, int] = {}
        pending: list[int] = []
        # The heads that operations of this batch would have left but will not: a later
        # operation whose base is one was decided on a state that never existed, and is
        # refused unapplied, even where the head it finds carries the same numbers (ABA: a
        # handle created twice starts at the same head; a conflicting retry names the
        # head its original left). Refused operations add theirs below. (A repeat inside
        # the batch needs none: what follows it on its first's head follows the first.)
        phantoms: dict[str, Guard] = {}
        for i, op in enumerate(ops):
            op_id = op.operation_id
            if op_id in stored:
                fingerprint, body = stored[op_id]
                results[i] = _stored_receipt(op, fingerprint, body)
                if isinstance(results[i], Rejection):
                    _leaves_phantoms(op, phantoms)
            elif op_id in first_in_batch:
                continue  # resolved against the first occurrence after the rounds
            else:
                first_in_batch[op_id] = i
                pending.append(i)

        # Each handle's last record before this commit: read before the guarded updates,
        # which point the heads at this commit's record.
        prevs = self._prevs(cur, ops, pending, results)
        # Where the record will end if every pending operation is written: guarded updates
        # point their heads at it, and insert_record then rewrites only the other heads.
        predicted = last + (len(event_ids) if len(pending) == len(ops) else sum(len(owned[i]) for i in pending))
        fault("before_update")
        for round_ in _rounds(ops, _chains(ops, pending)):
            rejected: dict[int, Rejection] = {}
            live = round_
            if phantoms:
                live = []
                for unit in round_:
                    if (handle := _phantom_base(ops[unit[0]], phantoms)) is None:
                        live.append(unit)
                    else:
                        rejected.update((i, _refused_after(ops[i], handle)) for i in unit)
            if live:
                rejected.update(self._apply_round(cur, ops, live, predicted))
            for i, rejection in rejected.items():
                results[i] = rejection
                _leaves_phantoms(ops[i], phantoms)
        fault("after_update")
        record, manifest_rows, self._committed = self._rows(ops, pending, results, last, chain, taken, prevs, keys,
                                                            owned, runs)
        self._committed_chain = chain if record is None else record[2]
        if len(first_in_batch) + len(stored) < len(ops):
            for i, op in enumerate(ops):  # a repeat inside one batch is a retry of the first
                if results[i] is None:
                    original = results[first_in_batch[op.operation_id]]
                    results[i] = (
                        original
                        if isinstance(original, Receipt) and original.fingerprint == op.fingerprint
                        else _conflict(op)
                    )
        if record is not None:
            pointed: set[str] = set()
            if self.sql.points_heads and record[0] == predicted:  # nothing refused: the prediction held
                pointed = {w.handle_id for i in pending for w in ops[i].writes if w.expected is not None}
            self.sql.insert_record(cur, record, pointed)
        if manifest_rows:
            self.sql.insert_manifests(cur, list(manifest_rows.items()))
        fault("before_commit")
        return results  # type: ignore[return-value]  # stored, rejected, _rows or the retry loop filled each slot

    def _prevs(self, cur: Any, ops: Sequence[Operation], indexes: list[int],
               results: list[Receipt | Rejection | None]) -> dict[str, int]:
        """The last record of each existing handle the operations at `indexes` still to
        be written write, as it stands before their guarded updates (which repoint the
        heads): from _tails when its first write's guard expects the position cached (if
        the guard holds, that is the head's; if not, the operation is refused and the
        pointer goes unused), else read from the heads."""
        prevs: dict[str, int] = {}
        unknown: list[str] = []
        for i in indexes:
            if results[i] is not None:
                continue
            for w in ops[i].writes:
                h = w.handle_id
                if h in prevs or h in unknown:
                    continue
                if w.expected is None:
                    prevs[h] = PREV_NONE  # created by this batch
                elif (tail := self._tails.get(h)) is not None and tail[0] == w.expected.stream_position:
                    prevs[h] = tail[1]
                else:
                    unknown.append(h)
        if unknown:
            prevs.update(self.sql.last_records(cur, unknown))
        return prevs

    def _remember(self) -> None:
        """The record just committed is now each handle's it wrote (see _tails)."""
        if len(self._tails) > 1 << 16:  # a cache: handles come and go
            self._tails.clear()
        self._tails.update(self._uncommitted)
        self._uncommitted = {}

    def _rows(
        self, ops: Sequence[Operation], indexes: Iterable[int], results: list[Receipt | Rejection | None],
        last: int, chain: bytes, taken: set[str], prevs: dict[str, int], keys: dict[str, int] | None = None,
        owned: list[list[str]] | None = None, all_runs: list[tuple[int, int]] | None = None,
    ) -> tuple[RecordRow | None, dict[str, bytes], int]:
        """The record (linked to `chain`) and the manifest rows of the operations at
        `indexes` not yet decided in `results`, at global positions after `last`; fills
        in their receipts. Returns them and the last position used. `prevs`: the last
        record of each existing handle it may write (SqlStatements.last_records; a handle
        not in it is new: PREV_NONE). An event id in
        `taken` (already stored) or written twice is CONSTRAINT_VIOLATION: nothing of
        the batch may commit (the caller's transaction rolls back). `keys`: the ids'
        keys, if known (records.id_keys); `owned`: each operation's event ids, if known;
        `all_runs`: id_runs of every id in `keys`, the record's when it writes them all."""
        self._uncommitted = {}  # a refused earlier attempt (the fast path) committed nothing
        now = time.time_ns()
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
                add_receipt(encode_receipt(len(own), None if op.derived else op.fingerprint, now, heads))
            event_ids.update(own)
            op_ids.append(op_id)
            for sha, manifest in op.manifests:  # where its allocation holds it, or itself
                manifest_rows[sha] = manifest_ref(allocated[sha]) if sha in allocated else pack_manifest(manifest)
            results[i] = receipt
        if not bodies:
            return None, manifest_rows, position
        if len(event_ids) != position - last or not taken.isdisjoint(event_ids):
            raise _reused_id(ops, op_ids, taken)
        if steps.count:
            receipts.append(steps.context())
        # pack passes a record without steps through as it is (all events' bytes)
        body = encode_record(steps.pack(bodies), receipts, FORMAT if steps.count else EVENTS_FORMAT)
        written = event_ids.union(op_ids)
        if keys is None:
            runs = id_runs(id_keys(written))
        elif all_runs is not None and len(written) == len(keys):  # written is a subset of keys' ids
            runs = all_runs
        else:
            runs = id_runs([keys[i] for i in written])
        streams = list(tails)
        prev = pack_prev([prevs.get(h, PREV_NONE) for h in streams])
        record = (position, last + 1, link(chain, body), body, streams, prev, runs)
        self._uncommitted = {h: (p, position) for h, p in tails.items()}
        return record, manifest_rows, position

    def _apply_round(self, cur: Any, ops: Sequence[Operation], units: list[list[int]],
                     last_record: int | None = None) -> dict[int, Rejection]:
        """Apply the guards of the units of one round (disjoint handles). A unit is one
        operation, or a chain of single-handle operations each starting from the head the
        previous one leaves: one guarded update from the chain's first base to its last
        head decides all of them. Returns the rejected operations; a rejected one leaves
        no row changed."""
        spans = False
        updates: list[tuple[StreamWrite, Guard]] = []
        creates: list[StreamWrite] = []
        checks: list[tuple[str, Guard]] = []

        def collect(unit: list[int]) -> None:
            nonlocal spans
            op = ops[unit[0]]
            if len(unit) > 1:  # a chain: first base, last head
                first, last = op.writes[0], ops[unit[-1]].writes[0]
                assert first.expected is not None  # _chains joins only guarded writes
                updates.append((StreamWrite(first.handle_id, first.expected, last.head, ()), first.expected))
                return
            spans = spans or len(op.writes) + len(op.checks) > 1
            for w in op.writes:
                if w.expected is None:
                    creates.append(w)
                else:
                    updates.append((w, w.expected))
            if op.checks:
                checks.extend((c.handle_id, c.expected) for c in op.checks)

        for unit in units:
            collect(unit)
        if spans:
            self.sql.savepoint(cur)
        rejected: dict[int, Rejection] = {}
        live = units
        while True:
            ok = self.sql.guarded_update(cur, updates, last_record)
            if creates:
                ok |= self.sql.create_heads(cur, creates)
            checked = self.sql.check_heads(cur, checks) if checks else set()
            if len(ok) == len(updates) + len(creates) and len(checked) == len(checks):
                break  # every guard held (handles are distinct within a round)
            partial = False
            for unit in live:
                op = ops[unit[0]]
                failed = [w for w in op.writes if w.handle_id not in ok]
                failed_checks = [c for c in op.checks if c.handle_id not in checked]
                if not failed and not failed_checks:
                    continue
                if len(failed) < len(op.writes):
                    partial = True  # some rows of this operation changed: undo the round
                if failed:
                    w = failed[0]
                    code = ErrorCode.STALE_BASE if w.expected else ErrorCode.HANDLE_EXISTS
                    handle = w.handle_id
                else:
                    code, handle = ErrorCode.STALE_BASE, failed_checks[0].handle_id
                rejected[unit[0]] = Rejection(
                    operation_id=op.operation_id,
                    code=code.value,
                    handle_id=handle,
                    message=(f"handle {handle} already exists" if code is ErrorCode.HANDLE_EXISTS
                             else f"head of {handle} moved past the expected base"),
                )
                # the rest of a chain (only guarded writes chain: STALE_BASE after its first)
                rejected.update((i, _refused_after(ops[i], handle)) for i in unit[1:])
            if not partial:
                break
            self.sql.rollback_to_savepoint(cur)
            live = [u for u in live if u[0] not in rejected]
            updates, creates, checks = [], [], []
            for unit in live:
                collect(unit)
        if spans:
            self.sql.release_savepoint(cur)
        return rejected

    # -- reading -----------------------------------------------------------------

    def read_stream(self, handle_id: str, after: int = 0) -> list[Event]:
        with self._lock:
            return self._read(lambda cur: self.sql.stream_events(cur, handle_id, after))

    def read_raw(self, after: int = 0, limit: int | None = None) -> Iterator[tuple[int, bytes]]:
        return self._pages(after, limit)

    def read_all(self, after: int = 0, limit: int | None = None) -> Iterator[Event]:
        # decoded in the records: a step row becomes its events without JSON in between
        return (e for _, e in self._pages(after, limit, "events"))

    def read_fold(self, after: int = 0) -> Iterator[FoldItem]:
        return (e for _, e in self._pages(after, None, "fold"))

    def _pages(self, after: int, limit: int | None, mode: str = "json") -> Iterator[tuple[int, Any]]:
        remaining = limit
        while remaining is None or remaining > 0:
            page = READ_PAGE if remaining is None else min(READ_PAGE, remaining)
            with self._lock:
                rows = self._read(partial(self.sql.bodies_after, after=after, limit=page, mode=mode))
            yield from rows
            if len(rows) < page:
                return
            after = rows[-1][0]
            if remaining is not None:
                remaining -= len(rows)

    def head(self, handle_id: str) -> HeadFacts | None:
        found = self.heads(handle_id=handle_id)
        return found.get(handle_id)

    def heads(
        self, *, prefix_identity_sha256: str | None = None, handle_id: str | None = None
    ) -> dict[str, HeadFacts]:
        with self._lock:
            rows = self._read(lambda cur: self.sql.heads(cur, prefix_identity_sha256, handle_id))
        return {row[0]: HeadFacts(*row[1:]) for row in rows}

    def existing(self, handle_ids: Sequence[str]) -> set[str]:
        handles = list(handle_ids)
        with self._lock:
            return set(self._read(lambda cur: self.sql.last_records(cur, handles)))

    def receipt(self, operation_id: str) -> Receipt | None:
        with self._lock:
            found = self._read(lambda cur: self.sql.fetch_receipts(cur, [operation_id]))
        if operation_id not in found:
            return None
        return receipt_decoder.decode(found[operation_id][1])

    def last_position(self) -> int:
        with self._lock:
            return self._read(self.sql.last_position)

    def manifest(self, manifest_sha256: str) -> bytes | None:
        with self._lock:
            return self._read(lambda cur: self.sql.manifest(cur, manifest_sha256))

    def save_checkpoint(self, name: str, position: int, state: bytes) -> None:
        self._check_process()
        with self._lock:
            try:
                self.sql.transaction(
                    lambda cur: self.sql.upsert_checkpoint(cur, name, position, state, time.time_ns())
                )
            except Exception as exc:  # noqa: BLE001 - any driver failure becomes a coded error (_driver_error)
                raise self._driver_error(exc) from None

    def load_checkpoint(self, name: str) -> tuple[int, bytes] | None:
        with self._lock:
            return self._read(lambda cur: self.sql.checkpoint(cur, name))

    def close(self) -> None:
        committer, self._committer = getattr(self, "_committer", None), None
        if committer is not None:
            committer.shutdown(wait=True)
        proxy, self._proxy = getattr(self, "_proxy", None), None
        if proxy is not None and os.getpid() == getattr(self, "_pid", os.getpid()):
            release(proxy)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.dispose(close=os.getpid() == getattr(self, "_pid", os.getpid()))

    # -- helpers -----------------------------------------------------------------

    def _read(self, fn: Callable[[Any], T]) -> T:
        self._check_process()
        try:
            return self.sql.read(fn)
        except Exception as exc:  # noqa: BLE001 - any driver failure becomes a coded error (_driver_error)
            raise self._driver_error(exc) from None

    def _check_process(self) -> None:
        if self._proxy is None:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "journal is closed")
        if os.getpid() != self._pid:
            # A connection shared across fork() corrupts both sides' protocol state.
            raise KvLedgerError(
                ErrorCode.INVALID_ARGUMENT, "journal opened in another process; open it after fork()"
            )

    def _driver_error(self, exc: BaseException) -> BaseException:
        """The coded error for a driver error; anything else (a bug) as it is."""
        if isinstance(exc, KvLedgerError) or not is_driver_error(exc):
            return exc
        return translate(exc, self.url)

    # -- audit copies (replay/import, verify) --------------------------------------

    def import_events(self, events: Iterable[tuple[Event, bytes]],
                      tables: Callable[[], ImportTables]) -> None:
        def load(cur: Any) -> None:
            self.sql.lock_and_last_position(cur)
            if self.sql.has_rows(cur):
                raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{self.display_url} is not empty: "
                                    "import loads an exported journal into an empty one")
            page: list[EventRow] = []
            size = 0
            for e, body in events:
                # The schema_version column describes the stored body, which an upcast
                # event no longer does: read it from the body itself.
                page.append((e.global_position, e.event_id, e.stream_id, e.stream_position,
                             e.event_type, _stored_version.decode(body).schema_version,
                             e.operation_id, body))
                size += len(body)
                if len(page) == READ_PAGE or size >= IMPORT_PAGE_BYTES:
                    self.sql.insert_events(cur, page)
                    page, size = [], 0
            if page:
                self.sql.insert_events(cur, page)
            derived = tables()
            head_rows = [StreamWrite(h, None, facts, ()) for h, facts in derived.heads.items()]
            receipt_rows = [(r.operation_id, r.fingerprint, r.first_global_position,
                             r.last_global_position, receipt_encoder.encode(r)) for r in derived.receipts]
            for i in range(0, len(head_rows), READ_PAGE):
                self.sql.create_heads(cur, head_rows[i:i + READ_PAGE])
            for i in range(0, len(receipt_rows), READ_PAGE):
                self.sql.insert_receipts(cur, receipt_rows[i:i + READ_PAGE])
            if derived.manifests:
                self.sql.insert_manifests(cur, [(sha, pack_manifest(m)) for sha, m in derived.manifests])

        self._check_process()
        with self._lock:
            try:
                self.sql.transaction(load)
            except KvLedgerError:
                raise
            except Exception as exc:  # noqa: BLE001 - any driver failure becomes a coded error (_driver_error)
                raise self._driver_error(exc) from None

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[Snapshot]:
        from kvledger.journal.snapshot import SqlSnapshot

        self._check_process()
        with self._lock:  # the connection is in the read transaction until the audit ends
            cur = self._call(self.sql.begin_read)
            try:
                yield SqlSnapshot(self.sql, cur, self._call)
            finally:
                with contextlib.suppress(Exception):  # a broken connection has nothing to end
                    self.sql.end_read(cur)

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - any driver failure becomes a coded error (_driver_error)
            raise self._driver_error(exc) from None

    def read_receipts(self) -> Iterator[Receipt]:
        after = 0
        while True:
            with self._lock:
                rows = self._read(partial(self.sql.receipt_bodies_after, after=after, limit=READ_PAGE))
            for _, body in rows:
                yield receipt_decoder.decode(body)
            if len(rows) < READ_PAGE:
                return
            after = rows[-1][0]


class _StoredVersion(msgspec.Struct):
    schema_version: int


_stored_version = msgspec.json.Decoder(_StoredVersion)


def _leaves_phantoms(op: Operation, phantoms: dict[str, Guard]) -> None:
    """`op` is not applied: the heads it would have left are phantoms (see _append)."""
    phantoms.update((w.handle_id, guard_of(w.head)) for w in op.writes)


def _phantom_base(op: Operation, phantoms: dict[str, Guard]) -> str | None:
    """The handle whose base `op` names is a head that a refused operation of its batch
    would have left, if any."""
    for w in op.writes:
        if w.expected is not None and phantoms.get(w.handle_id) == w.expected:
            return w.handle_id
    for c in op.checks:
        if phantoms.get(c.handle_id) == c.expected:
            return c.handle_id
    return None


def _refused_after(op: Operation, handle: str) -> Rejection:
    return Rejection(operation_id=op.operation_id, code=ErrorCode.STALE_BASE.value, handle_id=handle,
                     message=f"an earlier operation on {handle} in this batch was refused")


def _chains(ops: Sequence[Operation], indexes: list[int]) -> list[list[int]]:
    """Group operations into units. Consecutive single-handle operations on a handle
    where each names as its base exactly the head the previous one writes (what the
    command service builds when one batch publishes, emits and starts on a handle)
    become one chain: sequentially they succeed or fail together anyway, and one
    guarded update instead of one per operation is what makes them cheap."""
    units: list[list[int]] = []
    tail: dict[str, tuple[list[int], HeadFacts]] = {}  # handle -> (open chain, head it leaves)
    for i in indexes:
        op = ops[i]
        if len(op.writes) == 1 and not op.checks and op.writes[0].expected is not None:
            w = op.writes[0]
            chain = tail.get(w.handle_id)
            if chain is not None and guard_of(chain[1]) == w.expected:
                unit = chain[0]
                unit.append(i)
            else:
                unit = [i]
                units.append(unit)
            tail[w.handle_id] = (unit, w.head)
            continue
        units.append([i])
        for handle in [w.handle_id for w in op.writes] + [c.handle_id for c in op.checks]:
            tail.pop(handle, None)  # anything else on a handle ends its chain
    return units


def _rounds(ops: Sequence[Operation], units: list[list[int]]) -> Iterator[list[list[int]]]:
    """Split units, in order, into rounds that touch disjoint handles, so one
    set-based statement per round has sequential semantics."""
    current: list[list[int]] = []
    touched: set[str] = set()
    for unit in units:
        op = ops[unit[0]]
        if len(op.writes) == 1 and not op.checks:  # the common shape: one handle
            handle = op.writes[0].handle_id
            if handle in touched:
                yield current
                current, touched = [], set()
            current.append(unit)
            touched.add(handle)
            continue
        handles = {w.handle_id for w in op.writes} | {c.handle_id for c in op.checks}
        if handles & touched:
            yield current
            current, touched = [], set()
        current.append(unit)
        touched |= handles
    if current:
        yield current


# Operation.step rebuilds its events at steps.VERSIONS: the current versions, or no step.
_STEP_VERSIONS_CURRENT = tuple(CURRENT_VERSION[cls.event_type] for cls in DECODE_CHAIN) == STEP_VERSIONS


def _invalid(op: Operation, msg: str) -> KvLedgerError:
    return KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"operation {op.operation_id}: {msg}")


def _validate(op: Operation) -> None:
    if not op.writes:
        raise _invalid(op, "writes nothing")
    seen: set[str] = set()
    for w in op.writes:
        handle = w.handle_id
        if handle in seen:
            raise _invalid(op, f"writes {handle} twice")
        seen.add(handle)
        position = w.expected.stream_position if w.expected else 0
        if op.step is not None:  # the decode lane's values: three events at its versions
            x = op.step
            if len(op.writes) != 1 or w.events or not _STEP_VERSIONS_CURRENT:
                raise _invalid(op, "a decode step's values are its one write's events")
            if x.stream_id != handle or x.stream_position != position + 1:
                raise _invalid(op, f"its decode step is not at {handle}:{position + 1}")
            if x.global_position != 0:
                raise _invalid(op, "global_position is assigned by the journal")
            if w.head.stream_position != position + 3:
                raise _invalid(op, f"head of {handle} does not end at its last event")
            continue
        if not w.events:
            raise _invalid(op, f"write to {handle} has no events")
        for ev in w.events:
            position += 1
            if ev.stream_id != handle or ev.stream_position != position:
                raise _invalid(op, f"event {ev.event_id} is not at {handle}:{position}")
            if ev.global_position != 0:
                raise _invalid(op, "global_position is assigned by the journal")
            if ev.schema_version != CURRENT_VERSION[ev.event_type]:
                raise _invalid(op, f"{ev.event_type} must be written at schema_version "
                          f"{CURRENT_VERSION[ev.event_type]}")
        if w.head.stream_position != position:
            raise _invalid(op, f"head of {handle} does not end at its last event")


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


def _stored_receipt(op: Operation, fingerprint: str, body: bytes) -> Receipt | Rejection:
    """A retry's answer: the receipt stored under its operation id, or CONFLICT when the
    retry's fingerprint differs from the committed operation's."""
    if fingerprint != op.fingerprint:
        return _conflict(op)
    return receipt_decoder.decode(body)


def _conflict(op: Operation) -> Rejection:
    return Rejection(
        operation_id=op.operation_id,
        code=ErrorCode.CONFLICT.value,
        handle_id=op.writes[0].handle_id,
        message=f"operation {op.operation_id} was committed with another fingerprint",
    )


__all__ = ["Guard", "SqlJournal", "make_engine", "open_journal"]
