"""The SQL journal: one implementation of the contract for SQLite and PostgreSQL.

The algorithm lives here; journal.sqlite and journal.postgres supply the few
statements whose best form differs (per-row statements in-process vs. one set-based
statement per batch over the network). All SQL uses bound parameters.

One transaction per `append` call, holding the writer lock from its first statement:
  1. read the last record: positions are gapless and commit-ordered, records chained;
  2. look up receipts: a retry returns its original receipt, a changed retry is CONFLICT;
  3. guarded head updates, per round of operations on disjoint handles; an operation
     with a failed guard writes nothing (savepoint when an operation spans handles);
  4. insert the record (events and receipts), its lookup rows and manifests; a decode
     run's from its columns, a record of its own beside the commit's other operations;
  5. commit. Nothing is acknowledged before the commit returns.

journal.batching decides what it can before the statements (validation, chains, rounds,
guarded updates), journal.record_rows builds the commit's record, journal.connection
opens the engine.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from sqlalchemy.engine import URL

from kvledger.journal import faults, tuning
from kvledger.journal.batching import answer_stored, apply_rounds, batch_ids, resolve_repeats, validate
from kvledger.journal.connection import ConnectionLock, lost, make_engine, stuck
from kvledger.journal.contract import (
    Guard,
    HeadFacts,
    HeadMoves,
    ImportTables,
    Operation,
    Rejection,
    StreamWrite,
    head_moves,
)
from kvledger.journal.driver_errors import is_driver_error, release, translate
from kvledger.journal.faults import fault
from kvledger.journal.keys import PREV_NONE
from kvledger.journal.port import RETRY_S, DecodeRun, Journal, RunReceipts, RunThen, Snapshot, retried
from kvledger.journal.record_rows import Base, Known, RecordRow, build_record
from kvledger.journal.run_writer import SMALL, id_runs_of, run_record, validate_run
from kvledger.journal.sql_import import load_import
from kvledger.journal.statements import Statements, T
from kvledger.journal.step_values import FoldItem
from kvledger.journal.tables import JOURNAL_TABLES, REVISIONS, SCHEMA_REVISION, VERSION_TABLE, too_new
from kvledger.journal.tails import Tails
from kvledger.journal.url import parse_url, redact
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import Event
from kvledger.schemas.receipts import Receipt, receipt_decoder

READ_PAGE = 5000
R = TypeVar("R", bound=Sequence[Receipt | Rejection])  # an append's results: a list, or a run's receipts


def open_journal(raw_url: str) -> SqlJournal:
    """Open a migrated journal. An un-migrated database is NOT_MIGRATED (run `kvledger init`)."""
    url = parse_url(raw_url)
    return SqlJournal(url)


class SqlJournal(Journal):
    def reopen_url(self) -> str:
        return self.url.render_as_string(hide_password=False)

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
        self._lock = ConnectionLock()
        self._committer: ThreadPoolExecutor | None = None  # append_deferred's COMMIT thread
        # The single-statement append (see _append_speculative): the last global position
        # this connection committed, and a back-off after mispredictions.
        self._predicted: int | None = None
        self._committed = 0
        # ... and the chain digest of the last record it committed (what the next links to)
        self._predicted_chain = self._committed_chain = b""
        self._misses = 0
        self._skip = 0
        self._tails = Tails()  # each handle's last committed record: a new record's stream_prev, unread
        self._stuck = False  # a failed call left the connection unable to serve another
        self.retry_s = RETRY_S  # how long a read rides out a lost session (_read)
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
        # numpy (journal.blocks) loads with the journal, not at the first decode commit a serving loop waits on
        from kvledger.journal import blocks  # noqa: F401  # imported for its side effect: numpy loaded

    # -- writing -----------------------------------------------------------------

    def append(self, operations: Sequence[Operation]) -> list[Receipt | Rejection]:
        if not operations:
            return []
        for op in operations:
            validate(op)
        speculative = self._append_speculative if self.sql.speculative else None
        return self._now([op.operation_id for op in operations] if faults.INTENTS else [],
                         lambda cur: self._append(cur, operations), partial(speculative, operations) if speculative
                         else None)

    def append_run(self, run: DecodeRun, operations: Sequence[Operation], *, defer: bool = False
                   ) -> Callable[[], Sequence[Receipt | Rejection]]:
        """The run as one block from its columns (journal.run_writer), then `operations`, a
        worker's arrivals and finishes, by the general path as a record of their own in the
        same transaction; a run alone goes first to PostgreSQL's one-statement append."""
        if len(run) <= SMALL:
            return super().append_run(run, operations, defer=defer)
        validate_run(run)
        for op in operations:
            validate(op)
        intents = [*run.operation_ids(), *(op.operation_id for op in operations)] if faults.INTENTS else []
        if self.sql.speculative and not operations:  # one statement when it holds; the general path when not
            results = self._now(intents, lambda cur: self._append(cur, run.operations()),
                                partial(self._run_speculative, run))
        elif defer and self.sql.deferred_commit:
            return self._deferred(intents, partial(self._append_run, run=run, rest=operations))
        else:
            results = self._now(intents, partial(self._append_run, run=run, rest=operations))
        return lambda: results

    def _now(self, intents: list[str], body: Callable[[Any], R], speculative: Callable[[], R | None] | None = None
             ) -> R:
        """Run `body` in one transaction and commit; `intents`: the operation ids a
        crash test's fault points expect (faults.intend); `speculative`: a one-round-trip
        attempt first (None: not done)."""
        self._check_process()
        with self._lock:
            if faults.INTENTS:
                faults.intend(intents)
            try:
                if speculative is not None and self._predicted is not None:
                    fast = speculative()
                    if fast is not None:
                        fault("after_commit")
                        return fast
                results = self.sql.transaction(body)
                self._predicted, self._predicted_chain = self._committed, self._committed_chain
                self._tails.commit()
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
            validate(op)
        return self._deferred([op.operation_id for op in operations] if faults.INTENTS else [],
                              lambda cur: self._append(cur, operations))

    def _deferred(self, intents: list[str], body: Callable[[Any], R]) -> Callable[[], R]:
        """append_deferred's two halves of `body` (see _now for `intents`)."""
        self._check_process()
        self._lock.acquire()
        if faults.INTENTS:
            faults.intend(intents)
        try:
            cur = self.sql.begin()
            try:
                results = body(cur)
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

        def wait() -> R:
            nonlocal waited
            if waited:
                return results
            waited = True
            try:
                committed.result()
                self._tails.commit()
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
        if self._backing_off():
            return None
        handles: set[str] = set()
        op_ids: set[str] = set()
        updates: list[tuple[StreamWrite, Guard]] = []
        for op in ops:
            if len(op.writes) != 1 or op.checks or op.manifests:
                return None
            w = op.writes[0]
            if w.expected is None:
                return None
            handles.add(w.handle_id)
            op_ids.add(op.operation_id)
            updates.append((w, w.expected))
        if len(handles) != len(ops) or len(op_ids) != len(ops):
            return None
        prevs = self._tails.records([(w.handle_id, g.stream_position) for w, g in updates])
        if prevs is None:
            return None
        last = self._predicted
        assert last is not None
        results: list[Receipt | Rejection | None] = [None] * len(ops)
        record, _, _ = self._record(ops, range(len(ops)), results,
                                    Base(last, self._predicted_chain, time.time_ns(), set(), prevs))
        assert record is not None  # every operation writes an event
        if not self._speculate(head_moves(updates), record, lambda: (list(op_ids), [  # build_record made each receipt
                e for r in results if isinstance(r, Receipt) for e in r.event_ids]), last):
            return None
        return results  # type: ignore[return-value]  # build_record filled every slot

    def _run_speculative(self, run: DecodeRun) -> Sequence[Receipt | Rejection] | None:
        """_append_speculative of a run, its record built from its columns."""
        if self._backing_off():
            return None
        prevs = self._tails.records(zip(run.handle_ids, run.positions))
        if prevs is None:
            return None
        last = self._predicted
        assert last is not None
        self._tails.pending = {}
        written = run_record(run, last, self._predicted_chain, time.time_ns(), prevs, id_runs_of(run))
        if written is None:
            return None
        self._tails.pending = written.tails
        receipts = written.receipts
        ok = self._speculate(run.moves(), written.record, lambda: (run.operation_ids(), receipts.event_ids()), last)
        return receipts if ok else None

    def _backing_off(self) -> bool:
        """Whether to skip this speculation: the last ones missed (_speculate's back-off)."""
        if self._skip:
            self._skip -= 1
            return True
        return False

    def _speculate(self, updates: HeadMoves, record: RecordRow,
                   ids: Callable[[], tuple[list[str], list[str]]], last: int) -> bool:
        """The one-statement append of a record holding the operations and events whose ids
        `ids()` gives."""
        fault("before_update")
        if self.sql.append_if(updates, record, ids, last):
            self._predicted, self._predicted_chain, self._misses = record.last_position, record.chain, 0
            self._tails.commit()
            return True
        # Another writer moved the journal (or a guard failed, or this is a retry): back
        # off exponentially so a contended journal does not pay a wasted round trip each time.
        self._misses = min(self._misses + 1, 6)
        self._skip = (1 << self._misses) - 1
        return False

    def _append(self, cur: Any, ops: Sequence[Operation], after: tuple[int, bytes] | None = None
                ) -> list[Receipt | Rejection]:
        """The general path; `after`: the last record's position and chain, if this
        transaction wrote it (None: read)."""
        op_ids, event_ids, known = batch_ids(ops)
        last, chain, stored, taken = self.sql.begin_append(cur, op_ids, event_ids, known.runs, after)
        results: list[Receipt | Rejection | None] = [None] * len(ops)
        # The heads that operations of this batch would have left but will not: a later
        # operation whose base is one was decided on a state that never existed, and is
        # refused unapplied, even where the head it finds carries the same numbers (ABA: a
        # handle created twice starts at the same head; a conflicting retry names the
        # head its original left). Refused operations add theirs. (A repeat inside
        # the batch needs none: what follows it on its first's head follows the first.)
        phantoms: dict[str, Guard] = {}
        first_in_batch, pending = answer_stored(ops, stored, results, phantoms)

        # Each handle's last record before this commit: read before the guarded updates,
        # which point the heads at this commit's record.
        prevs = self._prevs(cur, ops, pending, results)
        # Where the record will end if every pending operation is written: guarded updates
        # point their heads at it, and insert_record then rewrites only the other heads.
        predicted = last + (len(event_ids) if len(pending) == len(ops)
                            else sum(len(known.owned[i]) for i in pending))
        fault("before_update")
        apply_rounds(self.sql, cur, ops, pending, results, phantoms, predicted)
        fault("after_update")
        record, manifest_rows, self._committed = self._record(
            ops, pending, results, Base(last, chain, time.time_ns(), taken, prevs), known)
        self._committed_chain = chain if record is None else record.chain
        if len(first_in_batch) + len(stored) < len(ops):
            resolve_repeats(ops, results, first_in_batch)
        if record is not None:
            pointed: set[str] = set()
            if self.sql.points_heads and record.last_position == predicted:  # nothing refused: the prediction held
                pointed = {w.handle_id for i in pending for w in ops[i].writes}
            self.sql.insert_record(cur, record, pointed)
        if manifest_rows:
            self.sql.insert_manifests(cur, list(manifest_rows.items()))
        fault("before_commit")
        return results  # type: ignore[return-value]  # stored, rejected, build_record or the retry loop filled each slot

    def _append_run(self, cur: Any, run: DecodeRun, rest: Sequence[Operation] = ()) -> Sequence[Receipt | Rejection]:
        """The run's block, then `rest` as the general path's record; when the block does not hold, the
        general path for all of it, one record (so a refused step's phantom heads fence what follows)."""
        done = self._run_block(cur, run)
        if done is None:
            return self._append(cur, [*run.operations(), *rest])  # which refuses what failed
        if not rest:
            fault("before_commit")
            return done
        tails = self._tails.pending  # the run's, which the general path's record would drop
        after = self._append(cur, rest, (self._committed, self._committed_chain))  # the run's record is the last
        self._tails.pending = {**tails, **self._tails.pending}
        return RunThen(done, after)

    def _run_block(self, cur: Any, run: DecodeRun) -> RunReceipts | None:
        """The run's block record, when no id of it is stored and every guard holds (one
        statement for all of them); None, with nothing written, otherwise."""
        runs, (last, chain) = id_runs_of(run), self.sql.last_record(cur)
        written = None if self.sql.ids_stored(cur, runs) else run_record(
            run, last, chain, time.time_ns(), self._last_records(cur, zip(run.handle_ids, run.positions)), runs)
        if written is None:
            return None
        fault("before_update")
        if not self.sql.guard_all(cur, run.moves(), written.record.last_position):
            return None
        fault("after_update")
        self._tails.pending = written.tails
        self._committed, self._committed_chain = written.record.last_position, written.record.chain
        self.sql.insert_record(cur, written.record, frozenset(run.handle_ids))  # guard_all pointed each
        return written.receipts

    def _prevs(self, cur: Any, ops: Sequence[Operation], indexes: list[int],
               results: list[Receipt | Rejection | None]) -> dict[str, int]:
        """The last record of each existing handle the operations at `indexes` still to
        be written write, as it stands before their guarded updates (which repoint the
        heads): from _tails when its first write's guard expects the position cached (if
        the guard holds, that is the head's; if not, the operation is refused and the
        pointer goes unused), else read from the heads."""
        return self._last_records(cur, ((w.handle_id, None if w.expected is None else w.expected.stream_position)
                                        for i in indexes if results[i] is None for w in ops[i].writes))

    def _last_records(self, cur: Any, writes: Iterable[tuple[str, int | None]]) -> dict[str, int]:
        """_prevs of (handle, the stream position its first write's guard names) pairs."""
        prevs: dict[str, int] = {}
        unknown: dict[str, None] = {}  # in order, and a set
        for h, expected in writes:
            if h in prevs or h in unknown:
                continue
            if expected is None:
                prevs[h] = PREV_NONE  # created by this batch
            elif (record := self._tails.record(h, expected)) is not None:
                prevs[h] = record
            else:
                unknown[h] = None
        if unknown:
            prevs.update(self.sql.last_records(cur, list(unknown)))
        return prevs

    def _record(self, ops: Sequence[Operation], indexes: Iterable[int], results: list[Receipt | Rejection | None],
                base: Base, known: Known | None = None) -> tuple[RecordRow | None, dict[str, bytes], int]:
        """build_record's record, manifest rows and last position; the handles it writes
        wait in the tails' pending for the commit."""
        self._tails.pending = {}  # a refused earlier attempt (the fast path) committed nothing
        written = build_record(ops, indexes, results, base, known)
        self._tails.pending = written.tails
        return written.record, written.manifests, written.position

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
        return self.heads(handle_id=handle_id).get(handle_id)

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
            self._call(partial(self.sql.transaction, lambda cur: self.sql.upsert_checkpoint(cur, name, position, state,
                                                                                            time.time_ns())))

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
            return self._call(partial(self.sql.read, fn))
        except KvLedgerError:
            if not (self._stuck or lost(self.conn)):
                raise
        # the session is gone: a read has no outcome to lose, so it is read again on a new one
        return retried(partial(self._read_anew, fn), what="a read", seconds=self.retry_s)

    def _read_anew(self, fn: Callable[[Any], T]) -> T:
        self._reconnect()
        return self._call(partial(self.sql.read, fn))

    def _check_process(self) -> None:
        if self._proxy is None:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "journal is closed")
        if os.getpid() != self._pid:
            # A connection shared across fork() corrupts both sides' protocol state.
            raise KvLedgerError(
                ErrorCode.INVALID_ARGUMENT, "journal opened in another process; open it after fork()"
            )
        if self._stuck or lost(self.conn):  # the failed call raised (an append's outcome unknown): connect again
            with self._lock:
                self._reconnect()

    def _reconnect(self) -> None:
        release(self._proxy)  # invalidated: the pool resets nothing on a dead connection
        try:
            self._proxy = self.engine.raw_connection()
            self.conn = self._proxy.driver_connection
            self.sql = type(self.sql)(self.conn)
        except Exception as exc:  # noqa: BLE001 - any driver failure becomes a coded error (_driver_error)
            raise self._driver_error(exc) from None
        self._predicted, self._tails = None, Tails()  # what the lost session knew may not have committed
        self._stuck = False

    def _driver_error(self, exc: BaseException) -> BaseException:
        """The coded error for a driver error; anything else (a bug) as it is. A
        connection the failure left stuck is replaced at the next call."""
        if isinstance(exc, KvLedgerError) or not is_driver_error(exc):
            return exc
        self._stuck = self._stuck or stuck(self.conn)
        return translate(exc, self.url)

    # -- audit copies (replay/import, verify) --------------------------------------

    def import_events(self, events: Iterable[tuple[Event, bytes]],
                      tables: Callable[[], ImportTables]) -> None:
        self._check_process()
        with self._lock:
            self._call(partial(self.sql.transaction, partial(load_import, self.sql, events, tables, self.display_url)))

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


__all__ = ["Guard", "SqlJournal", "make_engine", "open_journal"]
