"""PostgreSQL specifics: every statement is a network round trip, so guarded updates,
head creation and event inserts are one set-based statement per batch (unnest of
bound arrays), and the writer lock is an explicit table lock.

The common append (every operation writes one existing handle) is one statement,
`append_if`: guarded updates, a verdict and the inserts, committed only if the verdict
holds; with the writer lock, one call of a function the session makes for itself
(pg_temp.kvl_append_if), one round trip. Anything else takes the general path: BEGIN
with the lock, the last position and stored receipts; the guarded updates per round;
the inserts; commit.
Over a network such a transaction runs in pipeline mode (statements whose results are
not needed travel with the next one whose results are: three round trips for the
general path). On a loopback or Unix-socket connection a round trip costs less than
psycopg's pipeline bookkeeping, so there statements go one by one
(journal.tuning.pipelined; KVLEDGER_PG_PIPELINE=on or off decides instead).

Columns travel as one array parameter each, in binary (see `_arrays`): a text-format
bytea array costs the client a hex encoding of every body, and the server parses
binary arrays faster than array literals.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager, nullcontext, suppress
from itertools import chain, repeat
from typing import Any, ClassVar

import psycopg
from psycopg.adapt import Dumper
from psycopg.pq import Format, TransactionStatus

from kvledger.journal import faults, tuning
from kvledger.journal.contract import Guard, HeadMoves, Integrity, StreamWrite, head_moves
from kvledger.journal.keys import stab
from kvledger.journal.record_rows import RecordRow
from kvledger.journal.statements import EventRow, ReceiptRow, Statements, T, _head_columns
from kvledger.journal.verify_reads import Row

_PIPELINE = psycopg.Pipeline.is_supported()


# The guarded head update's parts, one text for every statement that moves heads: each
# row's guard and new head from the bound columns, the new head's columns, a guard held.
_HEAD_ROWS = ("unnest(%(h)b, %(g)b, %(s)b, %(p)b, %(ng)b, %(ns)b, %(np)b, %(nc)b, %(ph)b) "
              "AS v(h, g, s, p, ng, ns, np, nc, ph)")
_NEW_HEAD = ("generation = v.ng, snapshot_version = v.ns, stream_position = v.np, committed_length = v.nc, "
             "lifecycle = v.ph")


def _guard_held(head: str, row: str) -> str:
    """The condition that the head `head` is at the guard of the row `row` (table aliases)."""
    return (f"{head}.handle_id = {row}.h AND {head}.generation = {row}.g "
            f"AND {head}.snapshot_version = {row}.s AND {head}.stream_position = {row}.p")


def _append_if(legacy: bool) -> str:
    """The one-statement append (PostgresStatements.append_if): the guarded head updates,
    a verdict, and the record with its lookup rows. The verdict is true only if every
    guard held, the last position is the one the record was numbered after (so the chain
    it links to is the last record's), and no operation has a receipt yet (none is a
    retry; a key another operation shares only sends this append down the general path),
    all read under the writer lock in the statement's snapshot. A false verdict makes the
    record's position NULL: the insert fails (not-null violation), so the transaction,
    head updates included, rolls back and nothing is committed. `legacy`: the ids and the
    last position are looked for in the one-row-per-event tables too."""
    return (
        f"WITH u AS (UPDATE kvl_heads AS h SET {_NEW_HEAD}, last_record = %(rlast)b::bigint "
        f"FROM {_HEAD_ROWS} WHERE {_guard_held('h', 'v')} RETURNING 1), "
        "verdict AS (SELECT (SELECT count(*) FROM u) = %(n)b::bigint "
        "AND coalesce((SELECT max(last_position) FROM kvl_records), "
        + ("(SELECT max(global_position) FROM kvl_events), " if legacy else "")
        + "0) = %(last)b::bigint "
        "AND NOT EXISTS (SELECT 1 FROM unnest(%(lo)b, %(hi)b, %(a)b) AS q(lo, hi, a) JOIN kvl_record_ids i "
        "ON i.first_key BETWEEN q.lo AND q.hi AND i.last_key >= q.a) "
        + ("AND NOT EXISTS (SELECT 1 FROM kvl_receipts WHERE operation_id = ANY(%(ops)b)) "
           "AND NOT EXISTS (SELECT 1 FROM kvl_events WHERE event_id = ANY(%(eids)b)) " if legacy else "")
        + "AS ok), "
        "r AS (INSERT INTO kvl_records (last_position, first_position, chain, body, stream_prev) "
        "SELECT CASE WHEN verdict.ok THEN %(rlast)b::bigint END, %(rfirst)b::bigint, %(chain)b, %(body)b, "
        "%(prev)b FROM verdict) "
        "INSERT INTO kvl_record_ids (first_key, last_key, last_position) "
        "SELECT f, l, %(rlast)b::bigint FROM unnest(%(rf)b, %(rl)b) AS k(f, l)"
    )


APPEND_IF = {legacy: _append_if(legacy) for legacy in (False, True)}
LOCK = "LOCK TABLE kvl_events IN EXCLUSIVE MODE"

# The one-statement append of a journal without pre-0003 rows as a function of the
# session (pg_temp: no schema change, no privilege beyond TEMP): the writer lock and the
# statement in one call, which autocommit runs and commits in one round trip (three
# apart: BEGIN with the lock, the statement, COMMIT). In a plpgsql function each
# statement takes its snapshot when it starts, so the append sees every commit made
# before it held the lock, as the separate statements do.
_APPEND_ARGS = (("h", "text[]"), ("g", "int8[]"), ("s", "int8[]"), ("p", "int8[]"), ("ng", "int8[]"),
                ("ns", "int8[]"), ("np", "int8[]"), ("nc", "int8[]"), ("ph", "text[]"), ("rlast", "int8"),
                ("rfirst", "int8"), ("chain", "bytea"), ("body", "bytea"), ("prev", "bytea"), ("n", "int8"),
                ("last", "int8"), ("lo", "int8[]"), ("hi", "int8[]"), ("a", "int8[]"), ("rf", "int8[]"),
                ("rl", "int8[]"))
APPEND_FUNCTION = (
    "CREATE FUNCTION pg_temp.kvl_append_if(" + ", ".join(f"a_{n} {t}" for n, t in _APPEND_ARGS)
    + ") RETURNS void LANGUAGE plpgsql AS $f$ BEGIN " + LOCK + "; "
    + re.sub(r"%\((\w+)\)b", r"a_\1", APPEND_IF[False]) + "; END $f$"
)
CALL_APPEND = ("SELECT pg_temp.kvl_append_if("
               + ", ".join(f"%({n})b::{t}" for n, t in _APPEND_ARGS) + ")")


class PostgresStatements(Statements):
    placeholder = "%s"

    def __init__(self, conn: Any) -> None:
        super().__init__(conn)
        if conn.info.transaction_status != 0:  # SQLAlchemy may have left one open
            conn.rollback()
        conn.autocommit = True  # reads see the newest commit; writes open their own txn
        host = conn.info.host or ""
        self.pipeline = _PIPELINE and tuning.pipelined(host)
        if conn.info.encoding not in ("utf-8", "utf8"):  # _texts sends UTF-8
            conn.execute("SET client_encoding TO 'UTF8'")
        # A write reads the journal's tail only once it holds the writers' lock, which READ
        # COMMITTED's statement snapshots see; a database whose default is REPEATABLE READ
        # or SERIALIZABLE would decide on a snapshot taken before the lock was granted. And
        # an acknowledged commit is durable: not under a database's synchronous_commit=off.
        [(_, durable)] = conn.execute("SELECT set_config('default_transaction_isolation', 'read committed', false), "
                                    "current_setting('synchronous_commit')").fetchall()
        if durable == "off":
            conn.execute("SET synchronous_commit TO on")
        _register_arrays(conn)

    def transaction(self, fn: Callable[[Any], T]) -> T:
        with self._locked() as cur:
            return fn(cur)

    def begin_read(self) -> Any:
        # REPEATABLE READ: every statement of the transaction sees the snapshot taken by
        # its first one, so a writer committing meanwhile is wholly visible or not at all.
        cur = self.conn.cursor()
        cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        return cur

    # The journal's own relations (tables and their btree indexes) in the current schema.
    AMCHECK_TARGETS = (
        "SELECT c.oid, c.relname, c.relkind FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "LEFT JOIN pg_am a ON a.oid = c.relam "
        "WHERE n.nspname = current_schema() AND c.relname LIKE 'kvl%' "
        "AND (c.relkind = 'r' OR (c.relkind = 'i' AND a.amname = 'btree')) ORDER BY c.relname"
    )

    def integrity(self, cur: Any) -> Integrity:
        """amcheck, when the database has it: bt_index_check on every btree index of the
        journal and (amcheck >= 1.3) verify_heapam on every table. Verify installs
        nothing: without the extension the check is skipped and says so."""
        cur.execute("SELECT extversion FROM pg_extension WHERE extname = 'amcheck'")
        row = cur.fetchone()
        if row is None:
            return Integrity("", skipped="the amcheck extension is not installed in this database "
                                         "(CREATE EXTENSION amcheck enables the storage check)")
        heap = tuple(int(x) for x in row[0].split(".")[:2]) >= (1, 3)
        cur.execute(self.AMCHECK_TARGETS)
        problems: list[str] = []
        skipped: list[str] = []
        counts = {"i": 0, "r": 0}
        for oid, name, kind in cur.fetchall():
            if kind == "r" and not heap:
                continue
            counts[kind] += 1
            cur.execute("SAVEPOINT kvl_amcheck")
            try:
                if kind == "i":
                    cur.execute("SELECT bt_index_check(%s::oid::regclass)", (oid,))
                else:
                    cur.execute("SELECT blkno, offnum, msg FROM verify_heapam(%s::oid::regclass) "
                                "LIMIT 100", (oid,))
                    problems += [f"{name} block {b} item {o}: {m}" for b, o, m in cur.fetchall()]
                cur.execute("RELEASE SAVEPOINT kvl_amcheck")
            except psycopg.Error as exc:
                cur.execute("ROLLBACK TO SAVEPOINT kvl_amcheck")
                # Class XX is "internal error": data or index corruption. Anything else
                # (no privilege to run amcheck, say) means the check did not run.
                state = getattr(exc, "sqlstate", None) or ""
                text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                (problems if state.startswith("XX") else skipped).append(f"{name}: {text}")
        checked = f"amcheck: bt_index_check on {counts['i']} indexes" + (
            f", verify_heapam on {counts['r']} tables" if heap else "")
        return Integrity(checked, tuple(problems), "; ".join(skipped) or None)

    def existing_tables(self, names: tuple[str, ...]) -> set[str]:
        with self.conn.cursor() as cur:
            cur.execute("SELECT n FROM unnest(%s::text[]) AS n WHERE to_regclass(n) IS NOT NULL", (list(names),))
            return {r[0] for r in cur.fetchall()}

    def schema_revision(self, version_table: str) -> str | None:
        if not self.existing_tables((version_table,)):
            return None
        with self.conn.cursor() as cur:
            cur.execute(f"SELECT version_num FROM {version_table}")  # constant table name
            row = cur.fetchone()
            return None if row is None else row[0]

    @contextmanager
    def _locked(self) -> Iterator[Any]:
        """A write transaction holding the writer lock, as its cursor: committed if the
        block returns, rolled back if it raises. The lock is the table's EXCLUSIVE mode,
        which conflicts with every writer but not with plain SELECTs: writers are
        serialized, so positions are gapless and in commit order, and readers never
        wait. Without a pipeline, BEGIN and the lock go as one simple query: one round
        trip, not two."""
        conn = self.conn
        if self.pipeline or conn.info.transaction_status != TransactionStatus.IDLE:
            # psycopg's block: its pipeline, and inside an open transaction a savepoint
            # (a failure then leaves that transaction as it was)
            with conn.pipeline() if self.pipeline else nullcontext(), conn.transaction(), conn.cursor() as cur:
                cur.execute(LOCK)
                yield cur
            return
        with conn.cursor() as cur:
            cur.execute("BEGIN; " + LOCK)  # constants; no parameters: the simple protocol takes both
            try:
                yield cur
            except BaseException:
                with suppress(psycopg.Error):  # a lost connection: what the block raised is the news
                    conn.rollback()
                raise
            conn.commit()

    speculative = True
    _function: bool | None = None  # whether this session made pg_temp.kvl_append_if (None: not yet asked)

    def _has_function(self) -> bool:
        if self._function is None:
            try:
                self.conn.execute(APPEND_FUNCTION)
                self._function = True
            except psycopg.errors.InsufficientPrivilege:  # no TEMP on this database: the statements apart
                self._function = False
        return self._function

    def append_if(self, updates: HeadMoves, record: RecordRow,
                  ids: Callable[[], tuple[list[str], list[str]]], last: int) -> bool:
        params = _guarded_update_params(updates)
        rlast, rfirst, chain_, body, _, prev, runs = record
        lo, hi, a = zip(*stab(runs))  # a record holds an event: one run at least
        params.update(
            lo=_int8s(lo), hi=_int8s(hi), a=_int8s(a), rf=_int8s([r[0] for r in runs]),
            rl=_int8s([r[1] for r in runs]), prev=prev, rlast=rlast, rfirst=rfirst, chain=chain_, body=body,
            n=len(updates.handle_ids), last=last,
        )
        legacy = self.has_event_rows(self.conn)
        if legacy:
            operation_ids, event_ids = ids()
            params.update(ops=_texts(operation_ids), eids=_texts(event_ids))
        try:
            if not legacy and self._has_function():
                with self.conn.cursor() as cur:
                    cur.execute(CALL_APPEND, params, prepare=True)  # autocommit: committed as it returns
            else:
                with self._locked() as cur:
                    cur.execute(APPEND_IF[legacy], params, prepare=True)  # planned once per connection
        except psycopg.errors.IntegrityError:
            # the verdict was false (or a row broke a constraint): rolled back, nothing
            # written; the general path decides what to do with these operations. (What
            # moved the journal under this connection may be a reset: look again.)
            self._event_rows = None
            return False
        return True

    # A join on unnest (no `handle_id = ANY(handles)` filter: in a generic plan a scan
    # would test every head against the whole array, one comparison per element).
    GUARDED_UPDATE_SET = (f"UPDATE kvl_heads AS h SET {_NEW_HEAD} FROM {_HEAD_ROWS} "
                          f"WHERE {_guard_held('h', 'v')} RETURNING h.handle_id")

    # guard_all's rows, all or none in one statement: each update also asks that every
    # guard holds (the handles are distinct, so all hold when all match). The verdict is
    # the rows it returns: in a pipeline a row count is unknown until a result is fetched.
    GUARD_ALL = (
        f"WITH v AS (SELECT * FROM {_HEAD_ROWS}) "
        f"UPDATE kvl_heads AS h SET {_NEW_HEAD}, last_record = %(rlast)b::bigint FROM v "
        f"WHERE {_guard_held('h', 'v')} "
        f"AND (SELECT count(*) FROM kvl_heads k JOIN v w ON {_guard_held('k', 'w')}) = %(n)b::bigint "
        "RETURNING 1"
    )

    def guard_all(self, cur: Any, moves: HeadMoves, last_record: int) -> bool:
        n = len(moves.handle_ids)
        cur.execute(self.GUARD_ALL, {**_guarded_update_params(moves), "n": n, "rlast": last_record})
        return len(cur.fetchall()) == n

    points_heads = False  # insert_record sets every head's last_record in one statement

    def guarded_update(self, cur: Any, rows: list[tuple[StreamWrite, Guard]],
                       last_record: int | None = None) -> set[str]:
        if not rows:
            return set()
        cur.execute(self.GUARDED_UPDATE_SET, _guarded_update_params(head_moves(rows)))
        return {r[0] for r in cur.fetchall()}

    def create_heads(self, cur: Any, writes: list[StreamWrite], last_record: int | None = None) -> set[str]:
        if not writes:
            return set()
        h, r, g, s, p, c, ph, pre, abi = zip(*[(w.handle_id, *_head_columns(w)) for w in writes])
        cur.execute(
            f"INSERT INTO kvl_heads ({self.HEAD_COLUMNS}) "
            "SELECT * FROM unnest(%b, %b, %b, %b, %b, %b, %b, %b, %b) "
            "ON CONFLICT (handle_id) DO NOTHING RETURNING handle_id",
            (_texts(h), _texts(r), _int8s(g), _int8s(s), _int8s(p), _int8s(c), _texts(ph),
             _texts(pre), _texts(abi)),
        )
        return {r[0] for r in cur.fetchall()}

    def check_heads(self, cur: Any, rows: list[tuple[str, Guard]]) -> set[str]:
        if not rows:
            return set()
        h, g, s, p = zip(*[(h, g.generation, g.snapshot_version, g.stream_position) for h, g in rows])
        cur.execute(
            "SELECT h.handle_id FROM kvl_heads h JOIN unnest(%b, %b, %b, %b) AS v(h, g, s, p) "
            "ON h.handle_id = v.h AND h.generation = v.g AND h.snapshot_version = v.s "
            "AND h.stream_position = v.p",
            (_texts(h), _int8s(g), _int8s(s), _int8s(p)),
        )
        return {r[0] for r in cur.fetchall()}

    def insert_events(self, cur: Any, rows: list[EventRow]) -> None:
        pos, eid, sid, sp, et, sv, op, body = zip(*rows)
        cur.execute(
            "INSERT INTO kvl_events (global_position, event_id, stream_id, stream_position, "
            "event_type, schema_version, operation_id, body) "
            "SELECT * FROM unnest(%b, %b, %b, %b, %b, %b, %b, %b)",
            (_int8s(pos), _texts(eid), _texts(sid), _int8s(sp), _texts(et), _int4s(sv), _texts(op),
             _byteas(body)),
        )

    def insert_receipts(self, cur: Any, rows: list[ReceiptRow]) -> None:
        op, fp, first, last, body = zip(*rows)
        cur.execute(
            "INSERT INTO kvl_receipts (operation_id, fingerprint, first_global_position, "
            "last_global_position, body) SELECT * FROM unnest(%b, %b, %b, %b, %b)",
            (_texts(op), _texts(fp), _int8s(first), _int8s(last), _byteas(body)),
        )

    def row_receipts(self, cur: Any, operation_ids: list[str]) -> dict[str, tuple[str, bytes]]:
        cur.execute(
            "SELECT operation_id, fingerprint, body FROM kvl_receipts WHERE operation_id = ANY(%b)",
            (_texts(operation_ids),),
        )
        return {r[0]: (r[1], bytes(r[2])) for r in cur.fetchall()}

    def row_event_ids(self, cur: Any, event_ids: list[str]) -> set[str]:
        if not event_ids:
            return set()
        cur.execute("SELECT event_id FROM kvl_events WHERE event_id = ANY(%b)", (_texts(event_ids),))
        return {r[0] for r in cur.fetchall()}

    def records_holding(self, cur: Any, runs: list[tuple[int, int]]) -> list[Row]:
        bounds = stab(runs)
        if not bounds:
            return []
        lo, hi, a = zip(*bounds)
        cur.execute(
            "SELECT r.last_position, r.body FROM kvl_records r WHERE r.last_position IN "
            "(SELECT i.last_position FROM unnest(%b, %b, %b) AS q(lo, hi, a) JOIN kvl_record_ids i "
            "ON i.first_key BETWEEN q.lo AND q.hi AND i.last_key >= q.a)",
            (_int8s(lo), _int8s(hi), _int8s(a)),
        )
        rows: list[Row] = cur.fetchall()
        return rows

    def last_record_rows(self, cur: Any, handles: list[str]) -> list[Row]:
        cur.execute("SELECT h.handle_id, h.last_record FROM kvl_heads h JOIN unnest(%b) AS v(h) ON h.handle_id = v.h",
                    (_texts(handles),))
        rows: list[Row] = cur.fetchall()
        return rows

    # The record, its handles' last_record and its id runs: one statement, one round trip.
    INSERT_RECORD_ALL = (
        "WITH r AS (INSERT INTO kvl_records (last_position, first_position, chain, body, stream_prev) "
        "VALUES (%(last)b::bigint, %(first)b::bigint, %(chain)b, %(body)b, %(prev)b)), "
        "u AS (UPDATE kvl_heads AS h SET last_record = %(last)b::bigint FROM unnest(%(h)b) AS v(h) "
        "WHERE h.handle_id = v.h) "
        "INSERT INTO kvl_record_ids (first_key, last_key, last_position) "
        "SELECT f, l, %(last)b::bigint FROM unnest(%(rf)b, %(rl)b) AS k(f, l)"
    )

    def insert_record(self, cur: Any, row: RecordRow, pointed: AbstractSet[str] = frozenset()) -> None:
        last, first, chain_, body, handles, prev, runs = row
        cur.execute(self.INSERT_RECORD_ALL, {
            "last": last, "first": first, "chain": chain_, "body": body, "prev": prev,
            "h": _texts([h for h in handles if h not in pointed]),
            "rf": _int8s([r[0] for r in runs]), "rl": _int8s([r[1] for r in runs])})
        faults.fault("mid_batch")  # the record and its lookup rows are written, the manifests not yet


def _guarded_update_params(m: HeadMoves) -> dict[str, Any]:
    return {"h": _texts(m.handle_ids), "g": _int8s(m.generations), "s": _int8s(m.snapshots),
            "p": _int8s(m.positions), "ng": _int8s(m.new_generations), "ns": _int8s(m.new_snapshots),
            "np": _int8s(m.new_positions), "nc": _int8s(m.committed), "ph": _texts(m.lifecycles)}


# -- arrays ---------------------------------------------------------------------------
#
# psycopg adapts a list element by element in Python (slow for a batch's lists, more
# than the server spends reading it). These build PostgreSQL's binary array format
# (array_send: ndim, has-null flag, element type, then per dimension size and lower
# bound, then per element a length, -1 for NULL, and the bytes) in a few C-level calls,
# and a dumper per element type hands the bytes to libpq as a typed binary parameter.

_HEAD = struct.Struct(">iiiii")


class _Array:
    __slots__ = ("data",)
    oid: ClassVar[int]  # the array type's, and its element type's
    elem: ClassVar[int]

    def __init__(self, data: bytes) -> None:
        self.data = data


class _Int8Array(_Array):
    __slots__ = ()
    oid, elem = 1016, 20


class _Int4Array(_Array):
    __slots__ = ()
    oid, elem = 1007, 23


class _TextArray(_Array):
    __slots__ = ()
    oid, elem = 1009, 25


class _ByteaArray(_Array):
    __slots__ = ()
    oid, elem = 1001, 17


_STRUCTS: dict[tuple[str, int], struct.Struct] = {}


def _ints(cls: type[_Array], code: str, size: int, values: Sequence[int]) -> _Array:
    n = len(values)
    if not n:
        return cls(struct.pack(">iii", 0, 0, cls.elem))
    packer = _STRUCTS.get((code, n))
    if packer is None:
        packer = struct.Struct(">" + ("i" + code) * n)
        if len(_STRUCTS) < 512:
            _STRUCTS[code, n] = packer
    try:
        body = packer.pack(*chain.from_iterable(zip(repeat(size, n), values)))
    except struct.error:  # NULL or not an integer of this size: let the server say so
        raise psycopg.DataError(f"cannot bind {values[:3]!r}... as an integer array") from None
    return cls(_HEAD.pack(1, 0, cls.elem, n, 1) + body)


def _int8s(values: Sequence[int]) -> _Array:
    return _ints(_Int8Array, "q", 8, values)


def _int4s(values: Sequence[int]) -> _Array:
    return _ints(_Int4Array, "i", 4, values)


def _varlena(cls: type[_Array], values: Sequence[Any], encode: bool) -> _Array:
    """`values`: str when `encode`, else bytes; None is NULL (see _texts, _byteas)."""
    n = len(values)
    if not n:
        return cls(struct.pack(">iii", 0, 0, cls.elem))
    parts: list[bytes] = [b""]
    add = parts.append
    nulls = 0
    for v in values:
        if v is None:
            nulls = 1
            add(b"\xff\xff\xff\xff")
            continue
        b = v.encode() if encode else v
        add(len(b).to_bytes(4, "big"))
        add(b)
    parts[0] = _HEAD.pack(1, nulls, cls.elem, n, 1)
    return cls(b"".join(parts))


def _texts(values: Sequence[str | None]) -> _Array:
    return _varlena(_TextArray, values, True)


def _byteas(values: Sequence[bytes | None]) -> _Array:
    return _varlena(_ByteaArray, values, False)


def _dumper(cls: type[_Array]) -> type[Dumper]:
    class ArrayDumper(Dumper):
        format = Format.BINARY
        oid = cls.oid

        def dump(self, obj: _Array) -> bytes:
            return obj.data

    return ArrayDumper


_DUMPERS = {cls: _dumper(cls) for cls in (_Int8Array, _Int4Array, _TextArray, _ByteaArray)}


def _register_arrays(conn: Any) -> None:
    for cls, dumper in _DUMPERS.items():
        conn.adapters.register_dumper(cls, dumper)


class PollingConnection(psycopg.Connection[Any]):
    """psycopg's connection, which polls its socket for the server's reply before it
    sleeps (journal.tuning.polled)."""

    def wait(self, gen: Any, *args: Any, **kwargs: Any) -> Any:  # psycopg's arguments moved in 3.2: passed through
        return super().wait(tuning.polled(gen, self.pgconn.socket), *args, **kwargs)


def polling_connect(dialect: Any, record: Any, cargs: Any, cparams: Any) -> PollingConnection:
    """SQLAlchemy's do_connect hook: the journal's connections are PollingConnections."""
    return PollingConnection.connect(*cargs, **cparams)
