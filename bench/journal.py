"""1. Journal append: conditional-write publications per second.

One publication = a guarded head update (`WHERE handle_id AND generation AND
snapshot_version AND stream_position`), one event row (a ~700-byte JSON body with a
~280-byte payload), one receipt row, and the commit. Measured single (one publication
per commit) and in batches of 64 publications on 64 distinct handles (one commit),
cycling through 1,024 live handles, for:

- kvledger: `SqlJournal.append` with real `Operation`s. Timed per batch: building the
  operations (msgspec structs), validation, encoding, the guarded transaction and
  receipts, and the commit. Event and operation ids are made as the engine makes them
  (a random prefix per writer and a counter); handle ids are random (see bench.ops).
- raw: the same rows on the same tables through the bare driver, the fastest correct
  way: sqlite3 `executemany` per statement inside one `BEGIN IMMEDIATE`; psycopg one
  data-modifying statement per batch (it updates the guarded heads and inserts the
  events and receipts of exactly the rows whose guard held) between LOCK and COMMIT,
  pipelined in one round trip or sent plainly, whichever is faster. Bodies are
  pre-encoded bytes of the same length as kvledger's, ids made the same way.
- eventsourcing: its SQLite and PostgreSQL `ApplicationRecorder.insert_events` (the
  recorder an eventsourcing application uses: optimistic concurrency on
  (originator_id, originator_version) and a global notification id), with
  `StoredEvent`s whose state has the length of kvledger's body, random uuid
  originators; a batch is one call with 64 originators.

Durable settings throughout: SQLite WAL + synchronous=FULL (set on eventsourcing's
connections too, and checked), PostgreSQL fsync=on. Several short runs per figure,
interleaved across systems (alternating order); a ratio is the median of the per-run
ratios kvledger / other (see bench.paired_ratio), an absolute rate the best run.

Also the cost of one disarmed fault point (journal.faults, six per append, armed only by
`kvledger crash-test`): `fault_point_disarmed_ns`, the best of a few timed loops.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from kvledger.engine.ids import new_id

from bench import Context, best_rate, paired_ratio
from bench.ops import Head, allocate_op, handle_ids, publish_op, random_hex

BATCH = 64

GOALS = {
    "journal_vs_raw_sqlite": (">=", 0.8),
    "journal_vs_raw_postgres": (">=", 0.8),
    "journal_vs_eventsourcing_sqlite": (">=", 1.3),
    "journal_vs_eventsourcing_postgres": (">=", 2.0),
    "journal_vs_eventsourcing_sqlite_single": (">=", 1.0),
    "journal_vs_eventsourcing_postgres_single": (">=", 1.0),
    "postgres_batched_events_per_s": (">=", 20000),
}

NOTES = {
    "journal_vs_raw_sqlite": "raw = bare SQL for the layout before revision 0003 (a row per event "
    "with four indexes, a receipt row); kvledger writes one compressed record per commit, with less "
    "WAL, and spends its time in Python deciding and encoding",
    "journal_vs_raw_postgres": "server work per batch is the same; kvledger spends 15-20 us of "
    "client CPU per publication against raw's 11-17 us; single commits are fsync-bound",
    "journal_vs_eventsourcing_sqlite": "not the same work: eventsourcing inserts one row per event "
    "with one index; kvledger decides each operation against its head, updates the heads and writes a "
    "chained, compressed record per commit with its lookup rows: ~7 us of Python a publication in place, "
    "and a cheaper COMMIT (10.7 KB of WAL a batch against eventsourcing's ~360 KB); issue 19 asks 1.0",
    "journal_vs_eventsourcing_postgres": "eventsourcing pays ~50-60 us of client CPU per event "
    "(psycopg adapting composite values); raw SQL for kvledger's rows is ~1.3-1.6x it, so 2x is out "
    "of reach for the same work",
    "postgres_batched_events_per_s": "server work per batch (4 index inserts per event, head "
    "updates, WAL flush): raw reaches 24-27k/s on a quiet machine, kvledger 20-24k/s",
}


# -- systems under test -------------------------------------------------------------


class System:
    """One database prepared with `handles` live handles; `write(idx)` commits one
    publication per handle index in `idx`, in one transaction."""

    backend = ""
    name = ""

    def write(self, idx: list[int]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Kvledger(System):
    name = "kvledger"

    def __init__(self, ctx: Context, backend: str, handles: int) -> None:
        from kvledger.journal import open_journal
        from kvledger.schemas.receipts import Receipt

        self.backend = backend
        url = ctx.sqlite_journal_url("kvl") if backend == "sqlite" else ctx.pg_journal_url("kvl")
        self.journal = open_journal(url)
        self.ids = new_id
        self.heads = [Head(h) for h in handle_ids(handles)]
        self._receipt = Receipt
        for i in range(0, handles, 256):
            ops = [allocate_op(h.handle, self.ids) for h in self.heads[i:i + 256]]
            self._check(self.journal.append(ops))

    def _check(self, results: list[Any]) -> None:
        receipt = self._receipt
        for r in results:
            if r.__class__ is not receipt:
                raise RuntimeError(f"benchmark publication rejected: {r}")

    def write(self, idx: list[int]) -> None:
        heads, ids = self.heads, self.ids
        self._check(self.journal.append([publish_op(heads[i], ids) for i in idx]))

    def close(self) -> None:
        self.journal.close()


def _sample_bodies() -> tuple[bytes, bytes]:
    """An event body and a receipt body exactly as kvledger stores them for one publication."""
    import msgspec

    from kvledger.schemas.codec import encode_event
    from kvledger.schemas.receipts import HandleResult, Receipt, receipt_encoder

    ids, h = new_id, Head(random_hex(1)[0])
    op = publish_op(h, ids)
    e = op.writes[0].events[0]
    body = encode_event(msgspec.structs.replace(e, global_position=123456))
    receipt = Receipt(op.operation_id, op.fingerprint, (HandleResult(h.handle, 0, 1, 2, 1),),
                      (e.event_id,), 123456, 123456, time.time_ns())
    return body, receipt_encoder.encode(receipt)


EVENT_BODY, RECEIPT_BODY = _sample_bodies()


class RawSqlite(System):
    backend, name = "sqlite", "raw"
    UPDATE = (
        "UPDATE kvl_heads SET generation = ?, snapshot_version = ?, stream_position = ?, "
        "committed_length = ?, lifecycle = ? "
        "WHERE handle_id = ? AND generation = ? AND snapshot_version = ? AND stream_position = ?"
    )
    EVENTS = (
        "INSERT INTO kvl_events (global_position, event_id, stream_id, stream_position, "
        "event_type, schema_version, operation_id, body) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
    )
    RECEIPTS = (
        "INSERT INTO kvl_receipts (operation_id, fingerprint, first_global_position, "
        "last_global_position, body) VALUES (?, ?, ?, ?, ?)"
    )
    HEAD = (
        "INSERT INTO kvl_heads (handle_id, request_id, generation, snapshot_version, "
        "stream_position, committed_length, lifecycle, prefix_identity_sha256, cache_abi_sha256) "
        "VALUES (?, ?, 0, 0, 1, 0, 'ACTIVE', ?, ?)"
    )

    def __init__(self, ctx: Context, handles: int) -> None:
        import sqlite3

        url = ctx.sqlite_journal_url("raw")
        self.conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None,
                                    check_same_thread=False, timeout=60)
        for pragma in ("journal_mode=WAL", "synchronous=FULL", "busy_timeout=60000", "foreign_keys=ON"):
            self.conn.execute(f"PRAGMA {pragma}")
        self.cur = self.conn.cursor()
        self.ids = new_id
        self.heads = [Head(h) for h in handle_ids(handles)]
        z = "0" * 64
        self.cur.execute("BEGIN IMMEDIATE")
        self.cur.executemany(self.HEAD, [(h.handle, h.handle, z, z) for h in self.heads])
        self.cur.executemany(self.EVENTS, [
            (i + 1, self.ids(), h.handle, 1, "request_allocate", 1, None, EVENT_BODY)
            for i, h in enumerate(self.heads)
        ])
        self.cur.execute("COMMIT")

    def write(self, idx: list[int]) -> None:
        cur, ids, heads, body, rbody = self.cur, self.ids, self.heads, EVENT_BODY, RECEIPT_BODY
        cur.execute("BEGIN IMMEDIATE")
        cur.execute("SELECT coalesce(max(global_position), 0) FROM kvl_events")
        pos = cur.fetchone()[0]
        updates, events, receipts = [], [], []
        for i in idx:
            h = heads[i]
            g, s, p = h.generation, h.snapshot, h.position
            pos += 1
            op = ids()
            updates.append((g, s + 1, p + 1, s + 1, "ACTIVE", h.handle, g, s, p))
            events.append((pos, ids(), h.handle, p + 1, "append_publish", 1, op, body))
            receipts.append((op, op, pos, pos, rbody))
        cur.executemany(self.UPDATE, updates)
        if cur.rowcount != len(idx):  # a stale guard: a real caller would redo per row
            cur.execute("ROLLBACK")
            raise RuntimeError("raw sqlite: guard failed")
        cur.executemany(self.EVENTS, events)
        cur.executemany(self.RECEIPTS, receipts)
        cur.execute("COMMIT")
        for i in idx:
            h = heads[i]
            h.snapshot += 1
            h.position += 1

    def close(self) -> None:
        self.conn.close()


class RawPostgres(System):
    """Pipelined: BEGIN, LOCK, the statement and COMMIT in one round trip; or plain: one
    round trip each (on loopback psycopg's pipeline bookkeeping can cost more than the
    round trips it saves). The baseline is the better of the two."""

    backend = "postgres"
    # One statement: the guarded head updates, then the events and receipts of exactly
    # the rows whose guard held, at gapless positions after the current last one.
    WRITE = (
        "WITH v AS (SELECT * FROM unnest(%b::text[], %b::bigint[], %b::bigint[], %b::bigint[], "
        "%b::text[], %b::text[], %b::bytea[], %b::bytea[]) WITH ORDINALITY "
        "AS v(h, g, s, p, eid, op, body, rbody, ord)), "
        "u AS (UPDATE kvl_heads AS t SET snapshot_version = v.s + 1, stream_position = v.p + 1, "
        "committed_length = v.s + 1, lifecycle = 'ACTIVE' FROM v WHERE t.handle_id = v.h "
        "AND t.generation = v.g AND t.snapshot_version = v.s AND t.stream_position = v.p "
        "RETURNING v.ord), "
        "ok AS (SELECT v.*, m.last + row_number() OVER (ORDER BY v.ord) AS pos FROM v "
        "JOIN u ON u.ord = v.ord CROSS JOIN (SELECT coalesce(max(global_position), 0) AS last "
        "FROM kvl_events) AS m), "
        "e AS (INSERT INTO kvl_events (global_position, event_id, stream_id, stream_position, "
        "event_type, schema_version, operation_id, body) SELECT pos, eid, h, p + 1, "
        "'append_publish', 1, op, body FROM ok) "
        "INSERT INTO kvl_receipts (operation_id, fingerprint, first_global_position, "
        "last_global_position, body) SELECT op, op, pos, pos, rbody FROM ok"
    )

    def __init__(self, ctx: Context, handles: int, pipeline: bool) -> None:
        import psycopg

        self.pipeline = pipeline
        self.name = "raw_pipelined" if pipeline else "raw_plain"
        url = ctx.pg_journal_url("raw")
        dbname = url.rsplit("/", 1)[1]
        self.conn = psycopg.connect(ctx.pg_conninfo(dbname), autocommit=True)
        self.ids = new_id
        self.heads = [Head(h) for h in handle_ids(handles)]
        z = "0" * 64
        with self.conn.transaction(), self.conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO kvl_heads (handle_id, request_id, generation, snapshot_version, "
                "stream_position, committed_length, lifecycle, prefix_identity_sha256, cache_abi_sha256) "
                "VALUES (%s, %s, 0, 0, 1, 0, 'ACTIVE', %s, %s)",
                [(h.handle, h.handle, z, z) for h in self.heads])
            cur.executemany(
                "INSERT INTO kvl_events (global_position, event_id, stream_id, stream_position, "
                "event_type, schema_version, operation_id, body) VALUES (%s, %s, %s, 1, "
                "'request_allocate', 1, NULL, %s)",
                [(i + 1, self.ids(), h.handle, EVENT_BODY) for i, h in enumerate(self.heads)])
        self.cur = self.conn.cursor()

    def write(self, idx: list[int]) -> None:
        ids, heads, n = self.ids, self.heads, len(idx)
        hs, gs, ss, ps, eids, ops = [], [], [], [], [], []
        for i in idx:
            h = heads[i]
            hs.append(h.handle)
            gs.append(h.generation)
            ss.append(h.snapshot)
            ps.append(h.position)
            ops.append(ids())
            eids.append(ids())
        cur = self.cur
        with self.conn.pipeline() if self.pipeline else nullcontext(), self.conn.transaction():
            cur.execute("LOCK TABLE kvl_events IN EXCLUSIVE MODE")
            cur.execute(self.WRITE, (hs, gs, ss, ps, eids, ops, [EVENT_BODY] * n, [RECEIPT_BODY] * n))
        if cur.rowcount != n:
            raise RuntimeError(f"raw postgres: {n - cur.rowcount} guards failed")
        for i in idx:
            h = heads[i]
            h.snapshot += 1
            h.position += 1

    def close(self) -> None:
        self.conn.close()


TOPIC = "bench.domain:Publication"


def _originators(n: int) -> list[uuid.UUID]:
    """Random originator ids, as an eventsourcing application makes (uuid4), like the
    random handle ids of the other systems."""
    return [uuid.UUID(h) for h in random_hex(n)]


class _Eventsourcing(System):
    """An eventsourcing ApplicationRecorder with `handles` originators at version 1."""

    def _populate(self, recorder: Any, handles: int) -> None:
        from eventsourcing.persistence import StoredEvent

        self.recorder, self.stored = recorder, StoredEvent
        recorder.create_table()
        self.originators = _originators(handles)
        self.versions = [1] * handles
        for i in range(0, handles, 256):
            recorder.insert_events([StoredEvent(o, 1, TOPIC, EVENT_BODY)
                                    for o in self.originators[i:i + 256]])

    def write(self, idx: list[int]) -> None:
        stored, originators, versions, body = self.stored, self.originators, self.versions, EVENT_BODY
        events = []
        for i in idx:
            v = versions[i] + 1
            versions[i] = v
            events.append(stored(originators[i], v, TOPIC, body))
        self.recorder.insert_events(events)

    def close(self) -> None:
        self.datastore.close()


class EventsourcingSqlite(_Eventsourcing):
    backend, name = "sqlite", "eventsourcing"

    def __init__(self, ctx: Context, handles: int) -> None:
        from eventsourcing.sqlite import SQLiteApplicationRecorder, SQLiteDatastore

        self.path = ctx.sqlite_path("es")
        self.datastore = SQLiteDatastore(str(self.path))
        # eventsourcing sets WAL itself but leaves synchronous at the library default:
        # set FULL on every connection its pool opens, like kvledger's. This wraps an
        # internal of eventsourcing 9.5 (the check below fails loudly if it changes).
        pool = self.datastore.pool
        create = pool._create_connection

        def durable_connection() -> Any:
            c = create()
            c._sqlite_conn.execute("PRAGMA synchronous=FULL")
            return c

        pool._create_connection = durable_connection
        self._populate(SQLiteApplicationRecorder(self.datastore), handles)
        with self.datastore.get_connection(commit=True) as conn:
            mode = conn._sqlite_conn.execute("PRAGMA journal_mode").fetchone()[0]
            sync = conn._sqlite_conn.execute("PRAGMA synchronous").fetchone()[0]
        if (mode.lower(), sync) != ("wal", 2):
            raise RuntimeError(f"eventsourcing sqlite not durable: journal_mode={mode} synchronous={sync}")


class EventsourcingPostgres(_Eventsourcing):
    backend, name = "postgres", "eventsourcing"

    def __init__(self, ctx: Context, handles: int) -> None:
        from eventsourcing.postgres import PostgresApplicationRecorder, PostgresDatastore

        dbname = ctx.pg_database("es")
        self.datastore = PostgresDatastore(dbname, "127.0.0.1", ctx.postgres().port, "postgres", "")
        self._populate(PostgresApplicationRecorder(self.datastore), handles)


# -- the section --------------------------------------------------------------------


def batches_round_robin(handles: int, size: int, count: int, start: int = 0) -> list[list[int]]:
    """`count` batches of `size` distinct handle indexes, cycling through all handles."""
    out, k = [], start
    for _ in range(count):
        out.append([(k + j) % handles for j in range(size)])
        k = (k + size) % handles
    return out


def measure(system: System, batches: list[list[int]]) -> float:
    """Publications per second over `batches`, one commit per batch."""
    write = system.write
    t0 = time.perf_counter()
    for b in batches:
        write(b)
    elapsed = time.perf_counter() - t0
    return sum(len(b) for b in batches) / elapsed


def fault_point_ns(calls: int, repeats: int = 3) -> float:
    """Nanoseconds one disarmed `journal.faults.fault` call costs (best of `repeats`)."""
    import timeit

    from kvledger.journal import faults

    faults.configure(None)
    best = min(timeit.repeat("fault('before_update')", globals={"fault": faults.fault}, number=calls,
                             repeat=repeats))
    return best / calls * 1e9


def run(ctx: Context) -> dict[str, Any]:
    handles = ctx.size(smoke=128, quick=1024, full=1024)
    n_batches = ctx.size(smoke=2, quick=40, full=120)  # per repeat, batches of 64
    n_single = ctx.size(smoke=4, quick=200, full=600)  # per repeat, one per commit
    repeats = ctx.size(smoke=1, quick=7, full=9)  # short runs, many: best-of is robust to bursts
    systems, unavailable = _open_systems(ctx, handles)
    try:
        rates = _rates(ctx, systems, handles, (n_batches, n_single, repeats))
    finally:
        for system in systems.values():
            system.close()
    out = _figures(rates, unavailable)
    out["event_body_bytes"] = len(EVENT_BODY)
    out["receipt_body_bytes"] = len(RECEIPT_BODY)
    out["handles"] = handles
    out["fault_point_disarmed_ns"] = round(fault_point_ns(ctx.size(smoke=10_000, quick=500_000, full=2_000_000)), 1)
    return out


def _open_systems(ctx: Context, handles: int) -> tuple[dict[tuple[str, str], System], dict[tuple[str, str], str]]:
    """Each (backend, system) that opens here, and why each of the others could not."""
    factories: dict[tuple[str, str], Callable[[], System]] = {
        ("sqlite", "kvledger"): lambda: Kvledger(ctx, "sqlite", handles),
        ("sqlite", "raw"): lambda: RawSqlite(ctx, handles),
        ("sqlite", "eventsourcing"): lambda: EventsourcingSqlite(ctx, handles),
        ("postgres", "kvledger"): lambda: Kvledger(ctx, "postgres", handles),
        ("postgres", "raw_pipelined"): lambda: RawPostgres(ctx, handles, pipeline=True),
        ("postgres", "raw_plain"): lambda: RawPostgres(ctx, handles, pipeline=False),
        ("postgres", "eventsourcing"): lambda: EventsourcingPostgres(ctx, handles),
    }
    systems: dict[tuple[str, str], System] = {}
    unavailable: dict[tuple[str, str], str] = {}
    try:
        for key, make in factories.items():
            try:
                systems[key] = make()
            except (ImportError, RuntimeError) as exc:  # a peer not installed; no PostgreSQL
                why = (f"{key[1]} not installed (no module {exc.name})" if isinstance(exc, ImportError)
                       else f"{key[1]} on {key[0]} unavailable: {exc}")
                ctx.log(f"journal: {why}")
                unavailable[(key[0], key[1].removesuffix("_pipelined").removesuffix("_plain"))] = why
    except BaseException:
        for system in systems.values():
            system.close()
        raise
    return systems, unavailable


def _rates(ctx: Context, systems: dict[tuple[str, str], System], handles: int,
           sizes: tuple[int, int, int]) -> dict[tuple[str, str, str], list[float]]:
    """Events per second of each (backend, system, mode) in each repeat; `sizes`: the
    batches and the single commits per repeat, and the repeats."""
    n_batches, n_single, repeats = sizes
    rates: dict[tuple[str, str, str], list[float]] = {}
    cursor = {key: 0 for key in systems}

    def take(key: tuple[str, str], size: int, count: int) -> list[list[int]]:
        b = batches_round_robin(handles, size, count, cursor[key])
        cursor[key] = (cursor[key] + size * count) % handles
        return b

    for key, system in systems.items():  # warm up: caches, prepared statements
        measure(system, take(key, BATCH, max(1, n_batches // 10)))
        measure(system, take(key, 1, max(1, n_single // 10)))
    for rep in range(repeats):
        ctx.log(f"journal: repeat {rep + 1}/{repeats}")
        order = list(systems.items())  # interleaved, alternating order: same noise for all
        for (backend, name), system in (order if rep % 2 == 0 else order[::-1]):
            for mode, size, count in (("batch", BATCH, n_batches), ("single", 1, n_single)):
                r = measure(system, take((backend, name), size, count))
                rates.setdefault((backend, name, mode), []).append(r)
    return rates


def _figures(rates: dict[tuple[str, str, str], list[float]],
             unavailable: dict[tuple[str, str], str]) -> dict[str, Any]:
    """The report's rates and ratios, and `missing`: each figure not measured, and why."""
    out: dict[str, Any] = {}
    for mode in ("batch", "single"):  # raw on PostgreSQL: the better protocol, per repeat
        variants = [rates[("postgres", n, mode)] for n in ("raw_pipelined", "raw_plain")
                    if ("postgres", n, mode) in rates]
        if variants:
            rates[("postgres", "raw", mode)] = [max(r) for r in zip(*variants)]
    best = {k: best_rate(v) for k, v in rates.items()}
    for (backend, name, mode), r in sorted(best.items()):
        out[f"{backend}_{name}_{mode}_per_s"] = round(r, 1)
    out["runs_per_s"] = {f"{b}_{n}_{m}": [round(x) for x in v] for (b, n, m), v in sorted(rates.items())}
    missing: dict[str, str] = {}  # a figure that could not be measured, and why
    for backend in ("sqlite", "postgres"):
        why = unavailable.get((backend, "kvledger"))
        for other in ("raw", "eventsourcing"):
            for key, mode in ((f"journal_vs_{other}_{backend}", "batch"),
                              (f"journal_vs_{other}_{backend}_single", "single")):
                out[key] = paired_ratio(rates.get((backend, "kvledger", mode)), rates.get((backend, other, mode)))
                if out[key] is None:
                    missing[key] = why or unavailable.get((backend, other), "not measured")
    pg = best.get(("postgres", "kvledger", "batch"))
    out["postgres_batched_events_per_s"] = round(pg, 1) if pg else None
    if pg is None:
        missing["postgres_batched_events_per_s"] = unavailable.get(("postgres", "kvledger"), "not measured")
    out["missing"] = missing
    return out
