"""PostgreSQL specifics: every statement is a network round trip, so guarded updates,
head creation and event inserts are one set-based statement per batch (unnest of
bound arrays), and the writer lock is an explicit table lock.

Over a network a write transaction runs in pipeline mode: statements whose results are
not needed (BEGIN, LOCK, the inserts, COMMIT) travel with the next one whose results
are, so an append is three round trips: lock + last position + stored receipts; the
guarded updates; the inserts + commit; the common case takes one (append_if). On a
loopback or Unix-socket connection a round trip (~35 us) costs less than psycopg's
pipeline bookkeeping (~150 us per transaction), so there statements go one by one.

Columns travel as one array parameter each. psycopg adapts a list element by element in
Python (about 20 us per 64-element array, more than the server spends on it), so integer
and text columns are bound as array literals built in one join (`_ints`, `_texts`;
bound values, never SQL), and bytea columns in binary (`%b`): a text-format bytea array
costs a hex encoding of every body.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import psycopg

from journal import faults
from journal.contract import Guard, StreamWrite
from journal.statements import Statements, _head_columns

_PIPELINE = psycopg.Pipeline.is_supported()
_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}


def _ints(values: list[Any]) -> Any:
    """A bigint[]/int[] parameter: the array literal `{1,2,3}`, or the list itself when an
    element is not an int (psycopg adapts it, or refuses it)."""
    try:
        return "{" + ",".join(map(int.__str__, values)) + "}"
    except TypeError:
        return values


def _texts(values: list[Any]) -> Any:
    """A text[] parameter: every element double-quoted, `{"a","b"}`, when no element holds
    a quote or a backslash (ids do not; the literal is then exact); otherwise, or with a
    NULL, the list itself for psycopg to escape."""
    try:
        joined = '","'.join(values)
    except TypeError:  # None (NULL) or not a string
        return values
    if not values or "\\" in joined or joined.count('"') != 2 * (len(values) - 1):
        return values
    return '{"' + joined + '"}'


class PostgresStatements(Statements):
    placeholder = "%s"

    def __init__(self, conn: Any) -> None:
        super().__init__(conn)
        if conn.info.transaction_status != 0:  # SQLAlchemy may have left one open
            conn.rollback()
        conn.autocommit = True  # reads see the newest commit; writes open their own txn
        host = conn.info.host or ""
        self.pipeline = _PIPELINE and not (host.startswith("/") or host in _LOCAL_HOSTS)

    def _pipeline(self) -> Any:
        return self.conn.pipeline() if self.pipeline else nullcontext()

    def transaction(self, fn: Callable[[Any], Any]) -> Any:
        conn = self.conn
        with self._pipeline(), conn.transaction(), conn.cursor() as cur:
            return fn(cur)

    def schema_revision(self, version_table: str) -> str | None:
        with self.conn.cursor() as cur:
            cur.execute("SELECT to_regclass(%s) IS NOT NULL", (version_table,))
            if not cur.fetchone()[0]:
                return None
            cur.execute(f"SELECT version_num FROM {version_table}")  # constant table name
            row = cur.fetchone()
            return None if row is None else row[0]

    def lock_and_last_position(self, cur: Any) -> int:
        # EXCLUSIVE conflicts with every writer but not with plain SELECTs: writers are
        # serialized, so positions are gapless and in commit order, and readers never wait.
        cur.execute("LOCK TABLE kvl_events IN EXCLUSIVE MODE")
        return self.last_position(cur)

    def begin_append(self, cur: Any, operation_ids: list[str]) -> tuple[int, dict[str, tuple[str, bytes]]]:
        # The lock is pipelined with one statement that reads the last position (after the
        # lock is granted) and the stored receipts: one round trip.
        cur.execute("LOCK TABLE kvl_events IN EXCLUSIVE MODE")
        cur.execute(
            "SELECT m.last, r.operation_id, r.fingerprint, r.body FROM "
            "(SELECT coalesce(max(global_position), 0) AS last FROM kvl_events) AS m "
            "LEFT JOIN kvl_receipts AS r ON r.operation_id = ANY(%s::text[])",
            (_texts(operation_ids),),
        )
        rows = cur.fetchall()
        stored = {r[1]: (r[2], bytes(r[3])) for r in rows if r[1] is not None}
        return int(rows[0][0]), stored

    speculative = True
    # One statement: the guarded head updates, a verdict, and the event and receipt rows.
    # The verdict is true only if every guard held and the last position is the one the
    # rows were numbered after, both read under the writer lock in the statement's
    # snapshot. A false verdict makes every event position NULL: the insert fails
    # (not-null violation), so the transaction, head updates included, rolls back and
    # nothing is committed. An operation that already has a receipt (a retry) fails the
    # receipts primary key the same way.
    APPEND_IF = (
        "WITH u AS (UPDATE kvl_heads AS h SET generation = v.ng, snapshot_version = v.ns, "
        "stream_position = v.np, committed_length = v.nc, phase = v.ph "
        "FROM unnest(%(h)s::text[], %(g)s::bigint[], %(s)s::bigint[], %(p)s::bigint[], "
        "%(ng)s::bigint[], %(ns)s::bigint[], %(np)s::bigint[], %(nc)s::bigint[], %(ph)s::text[]) "
        "AS v(h, g, s, p, ng, ns, np, nc, ph) "
        "WHERE h.handle_id = ANY(%(h)s::text[]) AND h.handle_id = v.h AND h.generation = v.g "
        "AND h.snapshot_version = v.s AND h.stream_position = v.p RETURNING 1), "
        "verdict AS (SELECT (SELECT count(*) FROM u) = %(n)s::bigint "
        "AND (SELECT coalesce(max(global_position), 0) FROM kvl_events) = %(last)s::bigint AS ok), "
        "e AS (INSERT INTO kvl_events (global_position, event_id, stream_id, stream_position, "
        "event_type, schema_version, operation_id, body) "
        "SELECT CASE WHEN verdict.ok THEN x.pos END, x.eid, x.sid, x.sp, x.et, x.sv, x.oid, x.body "
        "FROM unnest(%(epos)s::bigint[], %(eid)s::text[], %(sid)s::text[], %(sp)s::bigint[], "
        "%(et)s::text[], %(sv)s::int[], %(eop)s::text[], %(body)b::bytea[]) "
        "AS x(pos, eid, sid, sp, et, sv, oid, body) CROSS JOIN verdict) "
        "INSERT INTO kvl_receipts (operation_id, fingerprint, first_global_position, "
        "last_global_position, body) "
        "SELECT * FROM unnest(%(op)s::text[], %(fp)s::text[], %(first)s::bigint[], "
        "%(lastpos)s::bigint[], %(rbody)b::bytea[])"
    )

    def append_if(self, updates: list[tuple[StreamWrite, Guard]], event_rows: list[tuple],
                  receipt_rows: list[tuple], last: int) -> bool:
        params = _guarded_update_params(updates)
        epos, eid, sid, sp, et, sv, eop, body = map(list, zip(*event_rows))
        op, fp, first, lastpos, rbody = map(list, zip(*receipt_rows))
        params.update(
            epos=_ints(epos), eid=_texts(eid), sid=_texts(sid), sp=_ints(sp), et=_texts(et),
            sv=_ints(sv), eop=_texts(eop), body=body, op=_texts(op), fp=_texts(fp),
            first=_ints(first), lastpos=_ints(lastpos), rbody=rbody, n=len(updates), last=last,
        )
        conn = self.conn
        try:
            with self._pipeline(), conn.transaction(), conn.cursor() as cur:
                cur.execute("LOCK TABLE kvl_events IN EXCLUSIVE MODE")
                cur.execute(self.APPEND_IF, params)
        except psycopg.errors.IntegrityError:
            # the verdict was false (or a row broke a constraint): rolled back, nothing
            # written; the general path decides what to do with these operations.
            return False
        return True

    GUARDED_UPDATE_SET = (
        # `handle_id = ANY(handles)` lets the planner find the rows by primary key at any
        # table size (a join on unnest alone is estimated blind: small tables get a
        # sequential scan of every head).
        "UPDATE kvl_heads AS h SET generation = v.ng, snapshot_version = v.ns, "
        "stream_position = v.np, committed_length = v.nc, phase = v.ph "
        "FROM unnest(%(h)s::text[], %(g)s::bigint[], %(s)s::bigint[], %(p)s::bigint[], "
        "%(ng)s::bigint[], %(ns)s::bigint[], %(np)s::bigint[], %(nc)s::bigint[], %(ph)s::text[]) "
        "AS v(h, g, s, p, ng, ns, np, nc, ph) "
        "WHERE h.handle_id = ANY(%(h)s::text[]) AND h.handle_id = v.h AND h.generation = v.g "
        "AND h.snapshot_version = v.s AND h.stream_position = v.p RETURNING h.handle_id"
    )

    # test-only mutant (journal.faults.UNGUARDED): the same update with its guard ignored
    UNGUARDED_UPDATE_SET = GUARDED_UPDATE_SET.replace(
        " AND h.generation = v.g AND h.snapshot_version = v.s AND h.stream_position = v.p", "")

    def guarded_update(self, cur: Any, rows: list[tuple[StreamWrite, Guard]]) -> set[str]:
        if not rows:
            return set()
        cur.execute(self.UNGUARDED_UPDATE_SET if faults.UNGUARDED else self.GUARDED_UPDATE_SET,
                    _guarded_update_params(rows))
        return {r[0] for r in cur.fetchall()}

    def create_heads(self, cur: Any, writes: list[StreamWrite]) -> set[str]:
        if not writes:
            return set()
        h, r, g, s, p, c, ph, pre, abi = map(list, zip(*[(w.handle_id, *_head_columns(w)) for w in writes]))
        cur.execute(
            f"INSERT INTO kvl_heads ({self.HEAD_COLUMNS}) "
            "SELECT * FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::bigint[], "
            "%s::bigint[], %s::bigint[], %s::text[], %s::text[], %s::text[]) "
            "ON CONFLICT (handle_id) DO NOTHING RETURNING handle_id",
            (_texts(h), _texts(r), _ints(g), _ints(s), _ints(p), _ints(c), _texts(ph), _texts(pre),
             _texts(abi)),
        )
        return {r[0] for r in cur.fetchall()}

    def check_heads(self, cur: Any, rows: list[tuple[str, Guard]]) -> set[str]:
        if not rows:
            return set()
        if faults.UNGUARDED: return {h for h, _ in rows}  # test-only mutant
        h, g, s, p = map(list, zip(*[(h, g.generation, g.snapshot_version, g.stream_position) for h, g in rows]))
        cur.execute(
            "SELECT h.handle_id FROM kvl_heads h JOIN unnest(%s::text[], %s::bigint[], "
            "%s::bigint[], %s::bigint[]) AS v(h, g, s, p) ON h.handle_id = v.h "
            "AND h.generation = v.g AND h.snapshot_version = v.s AND h.stream_position = v.p",
            (_texts(h), _ints(g), _ints(s), _ints(p)),
        )
        return {r[0] for r in cur.fetchall()}

    def insert_events(self, cur: Any, rows: list[tuple]) -> None:
        pos, eid, sid, sp, et, sv, op, body = map(list, zip(*rows))
        cur.execute(
            "INSERT INTO kvl_events (global_position, event_id, stream_id, stream_position, "
            "event_type, schema_version, operation_id, body) SELECT * FROM unnest("
            "%s::bigint[], %s::text[], %s::text[], %s::bigint[], %s::text[], %s::int[], "
            "%s::text[], %b::bytea[])",
            (_ints(pos), _texts(eid), _texts(sid), _ints(sp), _texts(et), _ints(sv), _texts(op), body),
        )

    def insert_receipts(self, cur: Any, rows: list[tuple]) -> None:
        op, fp, first, last, body = map(list, zip(*rows))
        cur.execute(
            "INSERT INTO kvl_receipts (operation_id, fingerprint, first_global_position, "
            "last_global_position, body) SELECT * FROM unnest(%s::text[], %s::text[], "
            "%s::bigint[], %s::bigint[], %b::bytea[])",
            (_texts(op), _texts(fp), _ints(first), _ints(last), body),
        )

    def fetch_receipts(self, cur: Any, operation_ids: list[str]) -> dict[str, tuple[str, bytes]]:
        cur.execute(
            "SELECT operation_id, fingerprint, body FROM kvl_receipts WHERE operation_id = ANY(%s::text[])",
            (_texts(operation_ids),),
        )
        return {r[0]: (r[1], bytes(r[2])) for r in cur.fetchall()}


def _guarded_update_params(rows: list[tuple[StreamWrite, Guard]]) -> dict[str, Any]:
    h, g, s, p, ng, ns, np_, nc, ph = map(list, zip(*[
        (w.handle_id, g.generation, g.snapshot_version, g.stream_position, w.head.generation,
         w.head.snapshot_version, w.head.stream_position, w.head.committed_length, w.head.phase)
        for w, g in rows
    ]))
    return {"h": _texts(h), "g": _ints(g), "s": _ints(s), "p": _ints(p), "ng": _ints(ng),
            "ns": _ints(ns), "np": _ints(np_), "nc": _ints(nc), "ph": _texts(ph)}
