"""SQL shared by both backends, written once with `?` placeholders.

journal.sqlite uses it as is; journal.postgres converts the placeholders and replaces
the statements whose best form differs over a network (set-based, one round trip).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from itertools import repeat
from typing import Any, TypeVar

import msgspec

from kvledger.journal import faults
from kvledger.journal.audit import audit_record, decode_record
from kvledger.journal.contract import Guard, HeadMoves, StreamWrite, head_moves
from kvledger.journal.keys import PREV_INDEXED, PREV_NONE, id_keys, id_runs, stab, stable_key, unpack_prev
from kvledger.journal.manifests import allocation_manifest, manifest_ref_position, unpack_manifest
from kvledger.journal.readback import Damage, Record
from kvledger.journal.record_format import GENESIS, block_records
from kvledger.journal.record_rows import RecordRow
from kvledger.journal.step_values import StepRun, StepValues
from kvledger.journal.verify_reads import Row, VerifyReads, stored_bytes, stored_int
from kvledger.schemas.codec import decode_event
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import Event

_json_encode = msgspec.json.Encoder().encode

# Cursors and connections are the driver's (sqlite3, psycopg): typed Any at that boundary.
T = TypeVar("T")
# (global_position, event_id, stream_id, stream_position, event_type, schema_version,
#  operation_id, body)
EventRow = tuple[int, str, str, int, str, int, str | None, bytes]
# (operation_id, fingerprint, first_global_position, last_global_position, body)
ReceiptRow = tuple[str, str, int, int, bytes]


class Statements(VerifyReads):
    placeholder = "?"
    # True when append_if exists: a whole append in one round trip, committed only if
    # its predictions hold (journal.sql.SqlJournal._append_speculative).
    speculative = False

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def q(self, sql: str) -> str:
        return sql if self.placeholder == "?" else sql.replace("?", self.placeholder)

    # -- transactions (backend-specific) --------------------------------------------
    # Whether begin()/end() let SqlJournal.append_deferred commit on another thread.
    deferred_commit = False

    @abc.abstractmethod
    def transaction(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(cursor)` in a write transaction holding the writer lock; commit if it
        returns, roll back if it raises."""

    # Only where deferred_commit is set (an optional capability, as append_if is).
    def begin(self) -> Any:
        """Open a write transaction holding the writer lock; return its cursor."""
        raise NotImplementedError

    def end(self, cur: Any, commit: bool) -> None:
        """COMMIT (or ROLLBACK) what begin() opened, and close its cursor."""
        raise NotImplementedError

    def read(self, fn: Callable[[Any], T]) -> T:
        cur = self.conn.cursor()
        try:
            return fn(cur)
        finally:
            cur.close()

    @abc.abstractmethod
    def schema_revision(self, version_table: str) -> str | None: ...

    @abc.abstractmethod
    def existing_tables(self, names: tuple[str, ...]) -> set[str]: ...

    # Only where speculative is set.
    def append_if(self, updates: HeadMoves, record: RecordRow,
                  ids: Callable[[], tuple[list[str], list[str]]], last: int) -> bool:
        """`ids()`: the operation ids and event ids of the record, asked for only where a
        table of them must be looked in."""
        raise NotImplementedError

    def begin_append(self, cur: Any, operation_ids: list[str], event_ids: list[str], runs: list[tuple[int, int]],
                     after: tuple[int, bytes] | None = None
                     ) -> tuple[int, bytes, dict[str, tuple[str, bytes]], set[str]]:
        """In a write transaction (which holds the writer lock): the last global position,
        the chain digest the next record links to (`after`, when the caller wrote that
        record in this transaction), the stored receipts of `operation_ids` and which of
        `event_ids` the journal already holds (`runs`: all their id keys, records.id_runs)."""
        last, chain = self.last_record(cur) if after is None else after
        return last, chain, *self.find_ids(cur, operation_ids, event_ids, runs)

    def last_records(self, cur: Any, handles: list[str]) -> dict[str, int]:
        """For each of `handles` that has a head: the last record holding its events, or
        PREV_INDEXED when that is a record written before 0006 (or none)."""
        if not handles:
            return {}
        return {h: PREV_INDEXED if r is None else stored_int(r, f"the last record of {h}")
                for h, r in self.last_record_rows(cur, handles)}

    def last_record_rows(self, cur: Any, handles: list[str]) -> list[Row]:
        """(handle_id, last_record) of each of `handles` that has a head, as stored."""
        return self._lookup(cur, "SELECT handle_id, last_record FROM kvl_heads WHERE handle_id IN "
                                 "(SELECT value FROM json_each(?))",
                            "SELECT handle_id, last_record FROM kvl_heads WHERE handle_id = ?", handles)

    def last_record(self, cur: Any) -> tuple[int, bytes]:
        """The last global position, and the last record's chain (GENESIS before any)."""
        cur.execute("SELECT last_position, chain FROM kvl_records ORDER BY last_position DESC LIMIT 1")
        row = cur.fetchone()
        if row is None:
            return self.last_position(cur), GENESIS
        return stored_int(row[0], "the last record's position"), stored_bytes(row[1], "the last record's chain")

    def savepoint(self, cur: Any) -> None:
        cur.execute("SAVEPOINT kvl_round")

    def rollback_to_savepoint(self, cur: Any) -> None:
        cur.execute("ROLLBACK TO SAVEPOINT kvl_round")

    def release_savepoint(self, cur: Any) -> None:
        cur.execute("RELEASE SAVEPOINT kvl_round")

    # -- guarded writes: per-row forms; postgres overrides with set-based ones -------
    GUARDED_UPDATE = (
        "UPDATE kvl_heads SET generation = ?, snapshot_version = ?, stream_position = ?, "
        "committed_length = ?, lifecycle = ? "
        "WHERE handle_id = ? AND generation = ? AND snapshot_version = ? AND stream_position = ?"
    )
    CREATE_HEAD = (  # last_record NULL when the caller does not know it (insert_record sets it)
        "INSERT INTO kvl_heads (handle_id, request_id, generation, snapshot_version, "
        "stream_position, committed_length, lifecycle, prefix_identity_sha256, cache_abi_sha256, last_record) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (handle_id) DO NOTHING"
    )
    CHECK_HEAD = (
        "SELECT 1 FROM kvl_heads WHERE handle_id = ? AND generation = ? "
        "AND snapshot_version = ? AND stream_position = ?"
    )

    SET_LIFECYCLE, SET_LIFECYCLE_AND_RECORD = "lifecycle = ? ", "lifecycle = ?, last_record = ? "
    assert SET_LIFECYCLE in GUARDED_UPDATE

    # Where set, guarded_update also points each head at the record the commit will write
    # (`last_record`), and insert_record then leaves those heads alone: the 64 head rows a
    # commit of decode chains rewrites are updated once, not twice.
    points_heads = True

    def guarded_update(self, cur: Any, rows: list[tuple[StreamWrite, Guard]],
                       last_record: int | None = None) -> set[str]:
        """Handles in `rows` are distinct. Many rows go through one executemany under a
        savepoint (guard_all); when not every guard held, the rows are redone one by one
        to learn which failed. `last_record`: the last position of the record this commit
        will write, if known, stored as each updated head's last_record."""
        sql, params = self._guarded(head_moves(rows), last_record)
        if len(rows) >= 4 and self._all_held(cur, sql, params):
            return {w.handle_id for w, _ in rows}
        ok = set()
        for (w, _), p in zip(rows, params):
            cur.execute(sql, p)
            if cur.rowcount == 1:
                ok.add(w.handle_id)
        return ok

    def guard_all(self, cur: Any, moves: HeadMoves, last_record: int) -> bool:
        """guarded_update of every move or none: True if every guard held; False, with
        nothing changed, if not."""
        return self._all_held(cur, *self._guarded(moves, last_record))

    def _guarded(self, m: HeadMoves, last_record: int | None) -> tuple[str, list[tuple[Any, ...]]]:
        """GUARDED_UPDATE (setting last_record, if given) and its parameters for the moves."""
        sql = self.GUARDED_UPDATE
        at: tuple[Any, ...] = ()
        if last_record is not None:
            sql, at = sql.replace(self.SET_LIFECYCLE, self.SET_LIFECYCLE_AND_RECORD), (repeat(last_record),)
        return self.q(sql), list(zip(m.new_generations, m.new_snapshots, m.new_positions, m.committed,
                                     m.lifecycles, *at, m.handle_ids, m.generations, m.snapshots, m.positions))

    def _all_held(self, cur: Any, sql: str, params: list[tuple[Any, ...]]) -> bool:
        """`sql` for every row of `params` in one executemany under a savepoint: a summed
        rowcount equal to the row count means every guard held (a handle matches at most
        one row); otherwise the savepoint undoes it."""
        cur.execute("SAVEPOINT kvl_guards")
        cur.executemany(sql, params)
        held = bool(cur.rowcount == len(params))
        if not held:
            cur.execute("ROLLBACK TO SAVEPOINT kvl_guards")
        cur.execute("RELEASE SAVEPOINT kvl_guards")
        return held

    def ids_stored(self, cur: Any, runs: list[tuple[int, int]]) -> bool:
        """Whether any stored id may have a key in `runs` (keys.id_runs): a record holding
        one, or rows of the one-row-per-event tables to look in."""
        return bool(self.records_holding(cur, runs)) or self.has_event_rows(cur)

    def create_heads(self, cur: Any, writes: list[StreamWrite], last_record: int | None = None) -> set[str]:
        """As guarded_update, for heads that must not exist yet (`last_record` as there)."""
        sql = self.q(self.CREATE_HEAD)
        params = [(w.handle_id, *_head_columns(w), last_record) for w in writes]
        if len(params) >= 4 and self._all_held(cur, sql, params):
            return {w.handle_id for w in writes}
        ok = set()
        for w, p in zip(writes, params):
            cur.execute(sql, p)
            if cur.rowcount == 1:
                ok.add(w.handle_id)
        return ok

    def check_heads(self, cur: Any, rows: list[tuple[str, Guard]]) -> set[str]:
        sql, ok = self.q(self.CHECK_HEAD), set()
        for handle_id, g in rows:
            cur.execute(sql, (handle_id, g.generation, g.snapshot_version, g.stream_position))
            if cur.fetchone() is not None:
                ok.add(handle_id)
        return ok

    INSERT_EVENTS = (
        "INSERT INTO kvl_events (global_position, event_id, stream_id, stream_position, "
        "event_type, schema_version, operation_id, body) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
    )
    INSERT_RECEIPTS = (
        "INSERT INTO kvl_receipts (operation_id, fingerprint, first_global_position, "
        "last_global_position, body) VALUES (?, ?, ?, ?, ?)"
    )

    def insert_events(self, cur: Any, rows: list[EventRow]) -> None:
        cur.executemany(self.q(self.INSERT_EVENTS), rows)

    def insert_receipts(self, cur: Any, rows: list[ReceiptRow]) -> None:
        cur.executemany(self.q(self.INSERT_RECEIPTS), rows)

    INSERT_RECORD = ("INSERT INTO kvl_records (last_position, first_position, chain, body, stream_prev) "
                     "VALUES (?, ?, ?, ?, ?)")
    INSERT_ID_RUNS = "INSERT INTO kvl_record_ids (first_key, last_key, last_position) VALUES (?, ?, ?)"
    # the head rows the guarded update just rewrote: no page a commit did not dirty already
    SET_LAST_RECORD = "UPDATE kvl_heads SET last_record = ? WHERE handle_id = ?"

    def insert_record(self, cur: Any, row: RecordRow, pointed: AbstractSet[str] = frozenset()) -> None:
        """The record, its id runs, and each of its handles' last_record, but for those
        in `pointed` (guarded_update already set it)."""
        last, first, chain, body, handles, prev, runs = row
        cur.execute(self.q(self.INSERT_RECORD), (last, first, chain, body, prev))
        faults.fault("mid_batch")  # the record is written, its lookup rows not yet
        cur.executemany(self.q(self.SET_LAST_RECORD), [(last, h) for h in handles if h not in pointed])
        cur.executemany(self.q(self.INSERT_ID_RUNS), [(a, b, last) for a, b in runs])

    def insert_manifests(self, cur: Any, rows: list[tuple[str, bytes]]) -> None:
        cur.executemany(
            self.q("INSERT INTO kvl_manifests (manifest_sha256, body) VALUES (?, ?) "
                   "ON CONFLICT (manifest_sha256) DO NOTHING"),
            rows,
        )

    FETCH_RECEIPT = "SELECT operation_id, fingerprint, body FROM kvl_receipts WHERE operation_id = ?"
    # Many ids in one statement: the ids travel as one bound JSON array (json_each), and
    # each is an index lookup; one statement instead of one per operation.
    FETCH_RECEIPTS = (
        "SELECT operation_id, fingerprint, body FROM kvl_receipts "
        "WHERE operation_id IN (SELECT value FROM json_each(?))"
    )

    json_each = True  # cleared when this SQLite was built without JSON functions

    def fetch_receipts(self, cur: Any, operation_ids: list[str]) -> dict[str, tuple[str, bytes]]:
        """(fingerprint, receipt body) of each of `operation_ids` that has a receipt,
        in a record or (written before records, or imported) in kvl_receipts."""
        return self.find_ids(cur, operation_ids, [])[0]

    def find_ids(self, cur: Any, operation_ids: list[str], event_ids: list[str],
                 runs: list[tuple[int, int]] | None = None) -> tuple[dict[str, tuple[str, bytes]], set[str]]:
        """The stored receipts of `operation_ids` (fingerprint, body), and which of
        `event_ids` are stored, in records or in the one-row-per-event tables. `runs`:
        the ids' keys as runs when the caller has them (records.id_runs)."""
        ops, events = set(operation_ids), set(event_ids)
        found: dict[str, tuple[str, bytes]] = {}
        taken: set[str] = set()
        if not ops and not events:
            return found, taken
        for last, body in self.records_holding(cur, id_runs(id_keys(ops | events)) if runs is None else runs):
            where = f"ending at position {last}"
            record = decode_record(stored_bytes(body, f"the record {where}"), where)
            ids = record.ids()  # a shared key names other ids' records too: keep the exact ones
            if ids is None:
                raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"an event of the record {where} does not "
                                    "decode (run `kvledger verify`)")
            taken |= ids[0] & events
            if ops & ids[1]:
                for receipt in record.receipts:
                    key = _receipt_key(receipt)
                    if key.operation_id in ops:
                        found[key.operation_id] = (key.fingerprint, receipt)
        if self.has_event_rows(cur):
            found.update(self.row_receipts(cur, [o for o in ops if o not in found]))
            taken |= self.row_event_ids(cur, [e for e in events if e not in taken])
        return found, taken

    # Whether the one-row-per-event tables may hold rows: None until this connection has
    # seen a record or such a row. A journal holding a record with them empty keeps them
    # empty (only an import writes them, and it needs an empty journal; nothing deletes them).
    _event_rows: bool | None = None

    def has_event_rows(self, cur: Any) -> bool:
        """Whether the one-row-per-event tables hold anything (written before revision
        0003, or imported); most journals have none, and skip their lookups. `cur`: a
        cursor, or a connection that executes."""
        if self._event_rows is not None:
            return self._event_rows
        record, rows = cur.execute("SELECT EXISTS (SELECT 1 FROM kvl_records), EXISTS (SELECT 1 FROM kvl_events) "
                                   "OR EXISTS (SELECT 1 FROM kvl_receipts)").fetchone()
        if record or rows:
            self._event_rows = bool(rows)
        return bool(rows)

    # One statement for many runs: the bounds travel as one bound JSON array (json_each).
    RECORDS_HOLDING_RUN = (
        "SELECT r.last_position, r.body FROM kvl_records r WHERE r.last_position IN "
        "(SELECT i.last_position FROM kvl_record_ids i WHERE i.first_key BETWEEN ? AND ? AND i.last_key >= ?)"
    )
    RECORDS_HOLDING_RUNS = (
        "SELECT r.last_position, r.body FROM kvl_records r WHERE r.last_position IN "
        "(SELECT i.last_position FROM json_each(?) q JOIN kvl_record_ids i "
        "ON i.first_key BETWEEN json_extract(q.value, '$[0]') AND json_extract(q.value, '$[1]') "
        "AND i.last_key >= json_extract(q.value, '$[2]'))"
    )

    def records_holding(self, cur: Any, runs: list[tuple[int, int]]) -> list[Row]:
        """(last_position, body) of each record whose id runs meet `runs` (records.id_runs)."""
        rows = self._lookup(cur, self.RECORDS_HOLDING_RUNS, self.RECORDS_HOLDING_RUN, stab(runs))
        return list({r[0]: r for r in rows}.values())  # one row a record

    def _lookup(self, cur: Any, many: str, one: str, values: list[Any]) -> list[Row]:
        """The rows `many` finds for all `values` at once (its parameter: them as one JSON
        array, through json_each), or where this SQLite has no JSON functions, the rows
        `one` finds for each value (a tuple: its parameters)."""
        if len(values) > 1 and self.json_each:
            try:
                cur.execute(self.q(many), (_json_encode(values),))
                found: list[Row] = cur.fetchall()
                return found
            except Exception as exc:
                if "json_each" not in str(exc):
                    raise
                self.json_each = False
        rows: list[Row] = []
        for v in values:
            cur.execute(self.q(one), v if isinstance(v, tuple) else (v,))
            rows += cur.fetchall()
        return rows

    def row_receipts(self, cur: Any, operation_ids: list[str]) -> dict[str, tuple[str, bytes]]:
        if not operation_ids:
            return {}
        return {r[0]: (r[1], bytes(r[2]))
                for r in self._lookup(cur, self.FETCH_RECEIPTS, self.FETCH_RECEIPT, operation_ids)}

    def row_event_ids(self, cur: Any, event_ids: list[str]) -> set[str]:
        if not event_ids:
            return set()
        return {r[0] for r in self._lookup(
            cur, "SELECT event_id FROM kvl_events WHERE event_id IN (SELECT value FROM json_each(?))",
            "SELECT event_id FROM kvl_events WHERE event_id = ?", event_ids)}

    # -- reads -------------------------------------------------------------------
    def last_position(self, cur: Any) -> int:
        # Records always follow the rows of the one-row-per-event layout.
        cur.execute("SELECT coalesce((SELECT max(last_position) FROM kvl_records), "
                    "(SELECT max(global_position) FROM kvl_events), 0)")
        return stored_int(cur.fetchone()[0], "the last global position")

    def stream_events(self, cur: Any, handle_id: str, after: int) -> list[Event]:
        cur.execute(
            self.q("SELECT body FROM kvl_events WHERE stream_id = ? AND stream_position > ? "
                   "ORDER BY stream_position"),
            (handle_id, after),
        )
        events = [decode_event(stored_bytes(r[0], f"a body of stream {handle_id}")) for r in cur.fetchall()]
        pointer = self.last_records(cur, [handle_id]).get(handle_id, PREV_INDEXED)
        chained: list[list[Event]] = []  # newest record first
        while pointer > 0:  # back along the chain, until the records hold nothing after `after`
            cur.execute(self.q("SELECT body, stream_prev FROM kvl_records WHERE last_position = ?"), (pointer,))
            row = cur.fetchone()
            where = f"ending at position {pointer}"
            record = None if row is None else decode_record(stored_bytes(row[0], f"the record {where}"), where)
            prev = None if row is None or row[1] is None else unpack_prev(stored_bytes(row[1], "a stream_prev"))
            own, pointer = chain_step(record, prev, handle_id, pointer, after, where)
            chained.append(own)
        if pointer == PREV_INDEXED:
            # the records before 0006: by their lookup rows (bounded by where the chain ended)
            cur.execute(
                self.q("SELECT r.last_position, r.body FROM kvl_record_streams s JOIN kvl_records r "
                       "ON r.last_position = s.last_position WHERE s.stream_key = ? ORDER BY s.last_position"),
                (stable_key(handle_id),),
            )
            for last, body in cur.fetchall():
                where = f"ending at position {last}"
                # the record holds other streams' events too (and a shared key's)
                events += [e for e in decode_record(stored_bytes(body, f"the record {where}"), where)
                           .stream_events(handle_id) if e.stream_position > after]
        for found in reversed(chained):
            events += found
        return events

    # Records a read decodes at a time: bounded memory, whatever a record holds. A decode
    # loop's records of one shape are read together (records.block_records): the more a
    # page holds, the fewer array calls a record.
    RECORD_PAGE = 64

    def bodies_after(self, cur: Any, after: int, limit: int, mode: str = "json") -> list[tuple[int, Any]]:
        """(global position, JSON body) of the events after `after`, at most `limit`.
        `mode` "events": the events themselves (a record's step rows rebuilt, never
        encoded); "fold": the same with each run of a record's step rows whole, as its
        StepRun, at its last position (a page may then cover more positions than `limit`)."""
        cur.execute(
            self.q("SELECT global_position, body FROM kvl_events WHERE global_position > ? "
                   "ORDER BY global_position LIMIT ?"),
            (after, limit),
        )
        rows: list[tuple[int, Any]] = [
            (stored_int(p, "a global position"), stored_bytes(b, f"the body at position {p}"))
            for p, b in cur.fetchall()]
        if mode != "json":
            rows = [(p, decode_event(b)) for p, b in rows]
        if len(rows) < limit:
            start = rows[-1][0] if rows else after
            for first, record in self.records_after(cur, start, mode == "fold"):
                if mode == "fold":
                    rows += positioned(first, record.folded(), start)
                else:
                    events = record.decoded() if mode == "events" else record.events
                    if first <= start:  # the record holding `start`: its events after it
                        events, first = events[start + 1 - first:], start + 1
                    rows += zip(range(first, first + len(events)), events)
                if len(rows) >= limit:
                    break
        return rows[:limit]

    def records_after(self, cur: Any, after: int, fold: bool = False) -> Iterator[tuple[int, Record]]:
        """(first position, record) of each record that ends past position `after`, in
        order; a page of records at a time (the caller stops when it has enough). With
        `fold`, decoded for a projector (records.decode_record)."""
        sql = self.q("SELECT last_position, first_position, body FROM kvl_records WHERE last_position > ? "
                     "ORDER BY last_position LIMIT ?")
        size = 4  # records read together (block_records): doubling, so that a short read reads little
        while True:
            cur.execute(sql, (after, self.RECORD_PAGE))
            page = cur.fetchall()
            at = 0
            while at < len(page):
                chunk, at = page[at:at + size], at + size
                # a decode loop's records read together; any other, or a damaged one, read
                # (and named) in its turn, after the records before it
                read = block_records([b if type(b) is bytes else b"" for _, _, b in chunk], fold)
                for (last, first, body), record in zip(chunk, read):
                    where = f"ending at position {last}"
                    if record is None:
                        record = decode_record(stored_bytes(body, f"the record {where}"), where, fold)
                    first = stored_int(first, f"the first position of the record {where}")
                    if first + record.count - 1 != last:  # its header's counts, which no CRC covers
                        raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"the record {where} holds {record.count} "
                                            f"events from position {first} (run `kvledger verify`)")
                    yield first, record
                    after = last
                size = min(2 * size, self.RECORD_PAGE)
            if len(page) < self.RECORD_PAGE:
                return

    HEAD_COLUMNS = (
        "handle_id, request_id, generation, snapshot_version, stream_position, "
        "committed_length, lifecycle, prefix_identity_sha256, cache_abi_sha256"
    )

    def heads(self, cur: Any, prefix: str | None, handle_id: str | None) -> list[Row]:
        sql = f"SELECT {self.HEAD_COLUMNS} FROM kvl_heads"  # constant column list, no input
        if handle_id is not None:
            cur.execute(self.q(sql + " WHERE handle_id = ?"), (handle_id,))
        elif prefix is not None:
            cur.execute(self.q(sql + " WHERE prefix_identity_sha256 = ?"), (prefix,))
        else:
            cur.execute(sql + " ORDER BY handle_id")
        rows: list[Row] = cur.fetchall()
        return rows

    def manifest(self, cur: Any, manifest_sha256: str) -> bytes | None:
        cur.execute(self.q("SELECT body FROM kvl_manifests WHERE manifest_sha256 = ?"), (manifest_sha256,))
        row = cur.fetchone()
        return None if row is None else self._manifest_body(cur, stored_bytes(row[0], f"manifest {manifest_sha256}"))

    def _manifest_body(self, cur: Any, stored: bytes) -> bytes:
        """A stored manifest's canonical JSON, whichever form it is stored in. One that
        cannot be resolved (a damaged reference or body) comes back as stored: its digest
        then does not match, which is what verify reports and readers refuse."""
        position = manifest_ref_position(stored)
        if position is None:
            return unpack_manifest(stored)
        cur.execute(self.q("SELECT first_position, body FROM kvl_records WHERE last_position >= ? "
                           "ORDER BY last_position LIMIT 1"), (position,))
        row = cur.fetchone()
        if row is None or not isinstance(row[0], int) or not isinstance(row[1], (bytes, bytearray, memoryview)):
            return stored
        found = audit_record(bytes(row[1]))
        at = position - row[0]
        if isinstance(found, Damage) or not 0 <= at < len(found.events):
            return stored
        return allocation_manifest(found.events[at]) or stored

    def upsert_checkpoint(self, cur: Any, name: str, position: int, state: bytes, now: int) -> None:
        cur.execute(
            self.q("INSERT INTO kvl_checkpoints (name, position, state, updated_wall_ns) "
                   "VALUES (?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET position = excluded.position, "
                   "state = excluded.state, updated_wall_ns = excluded.updated_wall_ns"),
            (name, position, state, now),
        )
        faults.fault("checkpoint")

    def checkpoint(self, cur: Any, name: str) -> tuple[int, bytes] | None:
        cur.execute(self.q("SELECT position, state FROM kvl_checkpoints WHERE name = ?"), (name,))
        row = cur.fetchone()
        return None if row is None else (int(row[0]), bytes(row[1]))

    # -- audit copies --------------------------------------------------------------
    def has_rows(self, cur: Any) -> bool:
        """Any event, head or receipt: an import needs a journal with none."""
        for table in ("kvl_events", "kvl_records", "kvl_heads", "kvl_receipts"):  # constant names, no input
            cur.execute(f"SELECT 1 FROM {table} LIMIT 1")
            if cur.fetchone() is not None:
                return True
        return False


def chain_step(record: Record | None, prev: list[int] | None, handle_id: str, pointer: int, after: int,
               where: str) -> tuple[list[Event], int]:
    """One step back along a stream's chain of records: the events of `handle_id` past
    `after` that the record at `pointer` (its stream links: `prev`) holds, and the
    pointer to the record before it on the stream (PREV_NONE: none is needed)."""
    streams = None if record is None else record.streams()
    if record is None or streams is None or prev is None or len(prev) != len(streams) or handle_id not in streams:
        raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"the chain of stream {handle_id} breaks at the "
                            f"record {where} (run `kvledger verify`)")
    own = record.stream_events(handle_id)
    earlier = prev[streams.index(handle_id)] if own[0].stream_position > after + 1 else PREV_NONE
    if earlier >= pointer:  # a chain only goes back: a damaged pointer must not loop the read
        raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"the chain of stream {handle_id} points from the "
                            f"record {where} to {earlier}, not back (run `kvledger verify`)")
    return [e for e in own if e.stream_position > after], earlier


def _head_columns(w: StreamWrite) -> tuple[str, int, int, int, int, str, str, str]:
    h = w.head
    return (h.request_id, h.generation, h.snapshot_version, h.stream_position, h.committed_length,
            h.lifecycle, h.prefix_identity_sha256, h.cache_abi_sha256)


class _ReceiptKey(msgspec.Struct):
    operation_id: str
    fingerprint: str


_receipt_key = msgspec.json.Decoder(_ReceiptKey).decode


def positioned(first: int, items: list[Any], after: int) -> list[tuple[int, Any]]:
    """A record's folded items from its position `first` on, those past `after`: a run of
    step rows at its last position, its steps one by one when `after` falls inside it
    (a step at its last position, or as its events when `after` falls inside the step)."""
    out: list[tuple[int, Any]] = []
    p = first
    for item in items:
        if type(item) is StepRun:
            end = p + 3 * item.count
            if p > after:
                out.append((end - 1, item))
            elif end - 1 > after:
                out += positioned(p, item.values(), after)
            p = end
        elif type(item) is StepValues:
            if p > after:
                out.append((p + 2, item))
            elif p + 2 > after:
                out += [(q, e) for q, e in zip(range(p, p + 3), item.events()) if q > after]
            p += 3
        else:
            if p > after:
                out.append((p, item))
            p += 1
    return out
